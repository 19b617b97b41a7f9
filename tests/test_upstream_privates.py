"""Every private name of an upstream package that mlxd uses, named in one place.

mlx, mlx-lm and mlx-vlm (and jinja2, uvicorn) promise nothing about their underscore names. Each one mlxd reads is
a row of ``PRIVATES`` below, with a check that exercises it the way mlxd does; a release that drops or changes one
fails here with the package, its installed version and the mlxd file that depends on it, not in a request.
``test_every_private_use_in_mlxd_is_named`` keeps the table honest: it walks mlxd's source and fails on an
underscore name of another object (or an underscore import) that is neither a row here nor mlxd's own.
The packages a row names carry an upper version bound in pyproject.toml; the installed versions must be inside it.
"""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Private:
    package: str  # the distribution, as pip names it
    name: str  # the private name as mlxd reads it
    used_in: str  # the mlxd file that depends on it
    check: Callable[[Path], None]

    def __str__(self) -> str:
        return f"{self.package}:{self.name}"


def _distributed_launch(tmp_path: Path) -> None:
    import mlx._distributed_utils.launch as launch

    from mlxd.launch import _MLX_LAUNCH

    assert callable(launch.main), "mlx._distributed_utils.launch.main is not callable"
    out = subprocess.run([sys.executable, "-c", _MLX_LAUNCH, "--help"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    for option in ("--backend", "--hostfile", "--hosts", "-n", "--env", "--starting-port"):
        assert option in out.stdout, f"mlx.launch --help no longer lists {option} (mlxd/launch.py passes it)"


def _distributed_hostfile(tmp_path: Path) -> None:
    from mlx._distributed_utils.common import Hostfile

    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([{"ssh": "m1", "ips": ["10.0.0.1"]}, {"ssh": "m2", "ips": ["10.0.0.2"]}]))
    assert [host.ssh_hostname for host in Hostfile.from_file(path).hosts] == ["m1", "m2"]
    with pytest.raises(ValueError):
        Hostfile.from_file(tmp_path / "missing.json")


def _batch_kv_cache_idx(tmp_path: Path) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    cache = BatchKVCache(left_padding=[2, 0])
    assert cache._idx == 0
    cache.update_and_fetch(mx.zeros((2, 1, 3, 4)), mx.zeros((2, 1, 3, 4)))
    cache.update_and_fetch(mx.zeros((2, 1, 1, 4)), mx.zeros((2, 1, 1, 4)))
    # The filled width of the buffer (padding included), where `offset` is per row less its padding.
    assert isinstance(cache._idx, int) and cache._idx == 4, cache._idx
    assert cache.offset.tolist() == [2, 4] and cache.keys.shape[2] >= 4


def _tokenizer_wrapper_tokenizer(tmp_path: Path) -> None:
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(WordLevel({"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}, unk_token="<unk>"))
    words.pre_tokenizer = Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="</s>")
    wrapper = TokenizerWrapper(hf)
    assert wrapper._tokenizer is hf, "TokenizerWrapper._tokenizer is not the Hugging Face tokenizer it wraps"


def _mtp_head(tmp_path: Path):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import ModelConfig, Qwen3_5MTPDraftModel

    text = {"model_type": "qwen3_5_text", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "rms_norm_eps": 1e-6,
            "vocab_size": 11, "max_position_embeddings": 256, "linear_num_value_heads": 2, "linear_num_key_heads": 1, "linear_key_head_dim": 32,
            "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "tie_word_embeddings": True,
            "rope_parameters": {"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.5},
            "mtp_num_hidden_layers": 1}

    class Target(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(11, 32)
            self.embed_scale = 2.0

    target = Target()
    head = Qwen3_5MTPDraftModel(ModelConfig.from_dict({"text_config": text})).bind(target)
    mx.eval(head.parameters(), target.parameters())
    return head, target


def _mtp_input_embed(tmp_path: Path) -> None:
    head, target = _mtp_head(tmp_path)
    # mlxd.engine.drafters.mtp embeds the head's tokens as ``head._input_embed(tokens) * head._input_embed_scale``.
    assert head._input_embed is target.embed_tokens and head._input_embed_scale == 2.0


def _mtp_forward_hidden(tmp_path: Path) -> None:
    import mlx.core as mx

    head, _ = _mtp_head(tmp_path)
    params = list(inspect.signature(head._forward_hidden).parameters)
    assert params == ["token_embed", "hidden", "cache", "position_ids"], params  # mtp.py passes them by position
    tokens = mx.array([[3, 5, 7]])
    embeds = head._input_embed(tokens) * head._input_embed_scale
    cache = head.make_cache()
    out = head._forward_hidden(embeds, mx.ones((1, 3, 32)), cache, mx.arange(3)[None])
    assert out.shape == (1, 3, 32) and cache[0].offset == 3


def _mtp_greedy_token(tmp_path: Path) -> None:
    import mlx.core as mx

    head, target = _mtp_head(tmp_path)
    hidden = mx.random.normal((2, 1, 32))
    expected = mx.argmax(target.embed_tokens.as_linear(hidden), axis=-1)
    assert head._greedy_token(hidden).tolist() == expected.tolist()  # the LM head's argmax, (B, 1)


def _jinja_pass_arg(tmp_path: Path) -> None:
    import jinja2
    from jinja2.utils import _PassArg

    @jinja2.pass_context
    def with_context(context, value):
        return value

    assert _PassArg.from_obj(with_context) is _PassArg.context and _PassArg.from_obj(len) is None


def _jinja_code_generator(tmp_path: Path) -> None:
    import jinja2
    import jinja2.compiler
    import jinja2.runtime

    generator = jinja2.compiler.CodeGenerator
    assert list(inspect.signature(generator.buffer).parameters) == ["self", "frame"]
    assert list(inspect.signature(generator.visit_Concat).parameters) == ["self", "node", "frame"]
    assert callable(generator.temporary_identifier) and callable(generator.writeline)
    assert jinja2.Environment.code_generator_class is jinja2.compiler.CodeGenerator
    assert jinja2.runtime.str_join(["a", "b"]) == "ab"


def _uvicorn_protocol(name: str) -> Callable[[Path], None]:
    def check(tmp_path: Path) -> None:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        assert callable(getattr(HttpToolsProtocol, name, None)), f"HttpToolsProtocol.{name} is gone"

    return check


PRIVATES = [
    Private("mlx", "mlx._distributed_utils.launch.main", "mlxd/launch.py", _distributed_launch),
    Private("mlx", "mlx._distributed_utils.common.Hostfile", "mlxd/launch.py", _distributed_hostfile),
    Private("mlx-lm", "BatchKVCache._idx", "mlxd/engine/step/padded.py", _batch_kv_cache_idx),
    Private("mlx-lm", "TokenizerWrapper._tokenizer", "mlxd/constraints/grammar.py", _tokenizer_wrapper_tokenizer),
    Private("mlx-vlm", "Qwen3_5MTPDraftModel._input_embed", "mlxd/engine/drafters/mtp.py", _mtp_input_embed),
    Private("mlx-vlm", "Qwen3_5MTPDraftModel._input_embed_scale", "mlxd/engine/drafters/mtp.py", _mtp_input_embed),
    Private("mlx-vlm", "Qwen3_5MTPDraftModel._forward_hidden", "mlxd/engine/drafters/mtp.py", _mtp_forward_hidden),
    Private("mlx-vlm", "Qwen3_5MTPDraftModel._greedy_token", "mlxd/engine/drafters/mtp.py", _mtp_greedy_token),
    Private("jinja2", "jinja2.utils._PassArg", "mlxd/pipeline/template_env.py", _jinja_pass_arg),
    Private("jinja2", "jinja2.compiler.CodeGenerator.buffer", "mlxd/pipeline/template_env.py",
            _jinja_code_generator),
    *(Private("uvicorn", f"HttpToolsProtocol.{name}", "mlxd/runtime/connections.py", _uvicorn_protocol(name))
      for name in ("_should_upgrade", "_unset_keepalive_if_required", "_unsupported_upgrade_warning")),
]


@pytest.mark.parametrize("private", PRIVATES, ids=str)
def test_each_upstream_private_mlxd_uses_still_works(private: Private, tmp_path: Path) -> None:
    try:
        private.check(tmp_path)
    except (AssertionError, AttributeError, ImportError, TypeError, ValueError) as e:
        pytest.fail(f"{private.name} of {private.package} {version(private.package)} is gone or changed "
                    f"({type(e).__name__}: {e}); {private.used_in} depends on it", pytrace=False)


# Underscore names of other objects that mlxd reads which are not upstream privates: its own objects' helpers
# (used across its own classes), the documented os._exit and NamedTuple._replace.
_MLXD_OWN = {"_check_name", "_deliver", "_loop", "_ticker", "_exit", "_drain_then_exit", "_launch", "_matmul",
             "_memo", "_rotary", "_write", "_replace"}
_UPSTREAM = ("mlx", "mlx_lm", "mlx_vlm", "jinja2", "uvicorn")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _upstream_bases(tree: ast.Module) -> set[str]:
    """Names this file imports from an upstream package (the roots of base classes that matter)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _UPSTREAM:
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in _UPSTREAM}
    return names


def _inherited_privates(cls: ast.ClassDef) -> set[str]:
    """``self._x`` read in a class but neither assigned nor defined in it: a private of its (upstream) base."""
    own, read = set(), set()
    for node in ast.walk(cls):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (own if isinstance(node.ctx, ast.Store) else read).add(node.attr)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "object.__setattr__" and node.args[1:]:
            own.add(getattr(node.args[1], "value", None))
        elif isinstance(node, ast.Assign):
            own |= {target.id for target in node.targets if isinstance(target, ast.Name)}
    return {name for name in read - own if _private(name)}


def _private_uses(source: str) -> set[str]:
    tree = ast.parse(source)
    upstream, found = _upstream_bases(tree), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            found |= {f"{module}.{a.name}" for a in node.names if _private(a.name)}
            found |= {module for part in module.split(".") if _private(part)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if any(_private(part) for part in a.name.split("."))}
        elif isinstance(node, ast.ClassDef) and any(ast.unparse(b).split(".")[0] in upstream for b in node.bases):
            found |= _inherited_privates(node)
        elif (isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr", "setattr")
              and node.args[1:] and isinstance(node.args[1], ast.Constant) and _private(str(node.args[1].value))):
            found.add(node.args[1].value)  # getattr(obj, "_name")
    return found


def test_every_private_use_in_mlxd_is_named() -> None:
    named = set()
    for private in PRIVATES:
        named |= {private.name, private.name.rsplit(".", 1)[-1], private.name.rsplit(".", 1)[0]}
    unnamed = {}
    for path in sorted((ROOT / "mlxd").rglob("*.py")):
        for name in _private_uses(path.read_text()) - named - _MLXD_OWN:
            unnamed.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not unnamed, (f"mlxd reads private names that tests/test_upstream_privates.py does not name: {unnamed}; "
                         "add a row to PRIVATES (upstream) or to _MLXD_OWN (mlxd's own)")


def test_the_scan_sees_a_private_use() -> None:
    source = ("from mlx_lm.models.cache import KVCache\nfrom x._y import z\nfrom a import _b\n"
              "class C(KVCache):\n    def f(self):\n        self._mine = 1\n        return self._idx, other._size\n"
              "class D:\n    def f(self):\n        return self._not_inherited, getattr(self, '_probed', None)\n")
    assert _private_uses(source) == {"_idx", "_size", "x._y", "a._b", "_probed"}


def _requirements() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    by_name: dict[str, list[Requirement]] = {}
    for line in listed:
        requirement = Requirement(line)
        by_name.setdefault(requirement.name.lower(), []).append(requirement)
    return by_name


@pytest.mark.parametrize("package", sorted({p.package for p in PRIVATES}))
def test_a_package_whose_privates_mlxd_uses_is_bounded_and_installed_inside_the_bounds(package: str) -> None:
    requirements = _requirements()[package]
    installed = version(package)
    for requirement in requirements:
        bounded = any(spec.operator in ("<", "<=", "==", "~=") for spec in requirement.specifier)
        assert bounded, f"pyproject.toml: {requirement} has no upper bound, yet mlxd uses private names of {package}"
        if requirement.marker is None or requirement.marker.evaluate({"extra": "cuda"}):
            assert requirement.specifier.contains(installed, prereleases=True), (
                f"{package} {installed} is installed, outside pyproject.toml's {requirement}")
