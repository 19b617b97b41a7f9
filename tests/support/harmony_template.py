"""A gpt-oss chat template for tests: OpenAI's Harmony format, rendered as the published template renders it.

Written from the published ``chat_template.jinja`` of ``openai/gpt-oss-20b`` (which tests cannot download); every
marker and every fixed line of text is kept. What it leaves out or does differently:

- the built-in ``browser`` and ``python`` tools (``builtin_tools``) and ``model_identity`` are not rendered;
- parameter types cover what requests send in practice (string, enum, number, integer, boolean, arrays of those,
  nested objects on one line, ``nullable``); ``oneOf`` and type lists render as ``any``;
- an assistant message with several tool calls renders each call (the published template renders only the first),
  and a tool result takes the name of the matching call, in order (the published one, the latest call's name);
- a tool without a description renders no ``//`` line instead of failing.

Variables besides ``messages``, ``tools`` and ``add_generation_prompt``: ``reasoning_effort`` (``low``,
``medium`` (default), ``high``). The date line uses ``strftime_now``, which ``transformers`` provides.
"""

GPT_OSS_TEMPLATE = """\
{#- A JSON-schema parameter type as the TypeScript-like type gpt-oss was trained on. -#}
{%- macro ts_type(spec) -%}
    {%- if spec.type == 'string' and spec.enum -%}{{- '"' + spec.enum | join('" | "') + '"' -}}
    {%- elif spec.type == 'string' -%}{{- 'string' -}}{%- if spec.nullable -%}{{- ' | null' -}}{%- endif -%}
    {%- elif spec.type in ('number', 'integer') -%}{{- 'number' -}}
    {%- elif spec.type == 'boolean' -%}{{- 'boolean' -}}
    {%- elif spec.type == 'array' -%}
        {%- if spec['items'] -%}{{- ts_type(spec['items']) + '[]' -}}{%- else -%}{{- 'any[]' -}}{%- endif -%}
        {%- if spec.nullable -%}{{- ' | null' -}}{%- endif -%}
    {%- elif spec.type == 'object' and spec.properties -%}
        {{- '{\\n' -}}
        {%- for name, prop in spec.properties.items() -%}
            {{- name -}}{%- if name not in (spec.required or []) -%}{{- '?' -}}{%- endif -%}
            {{- ': ' + ts_type(prop) -}}{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}
        {%- endfor -%}
        {{- '}' -}}
    {%- elif spec.type == 'object' -%}{{- 'object' -}}
    {%- else -%}{{- 'any' -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro tool_namespace(tools) -%}
    {{- '## functions\\n\\nnamespace functions {\\n\\n' -}}
    {%- for tool in tools -%}
        {%- set tool = tool.function if tool.function is defined else tool -%}
        {%- if tool.description -%}{{- '// ' + tool.description + '\\n' -}}{%- endif -%}
        {{- 'type ' + tool.name + ' = ' -}}
        {%- if tool.parameters and tool.parameters.properties -%}
            {{- '(_: {\\n' -}}
            {%- for name, spec in tool.parameters.properties.items() -%}
                {%- if spec.description -%}{{- '// ' + spec.description + '\\n' -}}{%- endif -%}
                {{- name -}}{%- if name not in (tool.parameters.required or []) -%}{{- '?' -}}{%- endif -%}
                {{- ': ' + ts_type(spec) -}}
                {%- if spec.default is defined and spec.enum -%}{{- ', // default: ' + spec.default -}}
                {%- elif spec.default is defined -%}{{- ', // default: ' + spec.default | tojson -}}{%- endif -%}
                {{- ',\\n' -}}
            {%- endfor -%}
            {{- '}) => any;\\n\\n' -}}
        {%- else -%}
            {{- '() => any;\\n\\n' -}}
        {%- endif -%}
    {%- endfor -%}
    {{- '} // namespace functions' -}}
{%- endmacro -%}
{#- The system message: identity, dates, reasoning effort, channels. -#}
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n' -}}
{{- 'Knowledge cutoff: 2024-06\\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\\n\\n' -}}
{{- 'Reasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium') + '\\n\\n' -}}
{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.' -}}
{%- if tools -%}{{- "\\nCalls to these tools must go to the commentary channel: 'functions'." -}}{%- endif -%}
{{- '<|end|>' -}}
{#- The developer message: the request's system prompt and its tools. -#}
{%- set loop_messages = messages -%}
{%- set instructions = '' -%}
{%- if messages and messages[0].role in ('system', 'developer') -%}
    {%- set instructions = messages[0].content -%}
    {%- set loop_messages = messages[1:] -%}
{%- endif -%}
{%- if instructions or tools -%}
    {{- '<|start|>developer<|message|>' -}}
    {%- if instructions -%}{{- '# Instructions\\n\\n' + instructions + '\\n\\n' -}}{%- endif -%}
    {%- if tools -%}{{- '# Tools\\n\\n' + tool_namespace(tools) -}}{%- endif -%}
    {{- '<|end|>' -}}
{%- endif -%}
{%- set ns = namespace(calls=[], next_result=0, answered=false) -%}
{%- for message in loop_messages -%}
    {%- if message.role == 'assistant' and message.tool_calls -%}
        {#- The reasoning before a call is kept only while no final answer follows it. -#}
        {%- set ns.answered = false -%}
        {%- for later in loop_messages[loop.index:] -%}
            {%- if later.role == 'assistant' and not later.tool_calls -%}{%- set ns.answered = true -%}{%- endif -%}
        {%- endfor -%}
        {%- set thinking = message.content or message.thinking -%}
        {%- if thinking and not ns.answered -%}
            {{- '<|start|>assistant<|channel|>analysis<|message|>' + thinking + '<|end|>' -}}
        {%- endif -%}
        {%- set ns.calls = [] -%}
        {%- set ns.next_result = 0 -%}
        {%- for call in message.tool_calls -%}
            {%- set call = call.function if call.function is defined else call -%}
            {%- set ns.calls = ns.calls + [call.name] -%}
            {{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary json<|message|>' -}}
            {{- call.arguments | tojson + '<|call|>' -}}
        {%- endfor -%}
    {%- elif message.role == 'assistant' -%}
        {%- if loop.last and not add_generation_prompt -%}
            {#- Training only: the last turn keeps its reasoning and ends with <|return|>. -#}
            {%- if message.thinking -%}
                {{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' -}}
            {%- endif -%}
            {{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|return|>' -}}
        {%- else -%}
            {{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' -}}
        {%- endif -%}
        {%- set ns.calls = [] -%}
    {%- elif message.role == 'tool' -%}
        {%- if not ns.calls -%}
            {{- raise_exception('a tool message must follow an assistant message with tool calls') -}}
        {%- endif -%}
        {%- set name = ns.calls[ns.next_result] if ns.next_result < ns.calls | length else ns.calls[-1] -%}
        {%- set ns.next_result = ns.next_result + 1 -%}
        {{- '<|start|>functions.' + name + ' to=assistant<|channel|>commentary<|message|>' -}}
        {{- message.content | tojson + '<|end|>' -}}
    {%- elif message.role == 'user' -%}
        {{- '<|start|>user<|message|>' + message.content + '<|end|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}
"""
