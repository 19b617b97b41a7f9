"""The Jinja internals that mlxd's bounded template sandbox (``mlxd.pipeline.template_env``) builds on, named in one
place: a Jinja release that drops or changes one fails here, not in a request."""

from __future__ import annotations

import inspect

import jinja2
import jinja2.compiler
import jinja2.runtime
import jinja2.utils


def test_the_code_generator_hooks_the_sandbox_overrides_exist_with_their_signatures():
    generator = jinja2.compiler.CodeGenerator
    assert list(inspect.signature(generator.buffer).parameters) == ["self", "frame"]
    assert list(inspect.signature(generator.visit_Concat).parameters) == ["self", "node", "frame"]
    assert hasattr(generator, "temporary_identifier") and hasattr(generator, "writeline")
    assert jinja2.Environment.code_generator_class is jinja2.compiler.CodeGenerator


def test_the_private_helpers_the_sandbox_calls_exist():
    assert jinja2.runtime.str_join(["a", "b"]) == "ab"

    @jinja2.pass_context
    def with_context(context, value):
        return value

    assert jinja2.utils._PassArg.from_obj(with_context) is jinja2.utils._PassArg.context
    assert jinja2.utils._PassArg.from_obj(len) is None
