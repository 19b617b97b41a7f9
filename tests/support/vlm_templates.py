"""Chat templates of the tiny vision-language fixtures (``tests.support.tiny_vlm``): every message, with image parts
rendered as each family's placeholder where they are."""

# The templates share these macros and a header that gathers the system prompt (a first system message, then the
# tools); each family then writes turns its own way. Content is a string or a list of parts, rendered in order.
TEMPLATE_HEAD = """\
{%- macro render_content(content) -%}
    {%- if content is string -%}{{- content -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}{{- part.text -}}
            {%- elif part.type in ('image', 'image_url') -%}{{- '@IMAGE@' -}}
            {%- elif part.type in ('video', 'video_url') -%}{{- '@VIDEO@' -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- macro render_message(message) -%}
    {%- if message.role == 'tool' -%}
        {{- '<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' -}}
    {%- else -%}
        {{- render_content(message.content) -}}
        {%- for tool_call in message.tool_calls or [] -%}
            {%- if tool_call.function is defined -%}{%- set tool_call = tool_call.function -%}{%- endif -%}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' -}}
            {%- if tool_call.arguments is string -%}{{- tool_call.arguments -}}
            {%- else -%}{{- tool_call.arguments | tojson -}}{%- endif -%}
            {{- '}\\n</tool_call>' -}}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(system='', prefix='') -%}
{%- set loop_messages = messages -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set ns.system = render_content(messages[0].content) -%}
    {%- set loop_messages = messages[1:] -%}
{%- endif -%}
{%- if tools -%}
    {%- if ns.system -%}{%- set ns.system = ns.system + '\\n\\n' -%}{%- endif -%}
    {%- set ns.system = ns.system + '# Tools\\n\\nYou may call one or more functions. Their signatures:\\n<tools>' -%}
    {%- for tool in tools -%}{%- set ns.system = ns.system + '\\n' + tool | tojson -%}{%- endfor -%}
    {%- set ns.system = ns.system + '\\n</tools>\\n\\nReturn each call as {"name": <function-name>, "arguments": '
        + '<args-json-object>} within <tool_call></tool_call> XML tags.' -%}
{%- endif -%}
"""

# Qwen2.5-VL / Qwen3-VL: ChatML; a tool result is a user turn, as in Qwen's own templates.
CHATML_TEMPLATE = """\
{%- if ns.system -%}{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}{%- endif -%}
{%- for message in loop_messages -%}
    {%- set role = 'user' if message.role == 'tool' else message.role -%}
    {{- '<|im_start|>' + role + '\\n' + render_message(message) + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

# Gemma 3: the system prompt opens the first turn; the assistant is "model".
GEMMA_TEMPLATE = """\
{%- set ns.prefix = ns.system + '\\n\\n' if ns.system else '' -%}
{%- for message in loop_messages -%}
    {%- set role = {'assistant': 'model', 'tool': 'user'}.get(message.role, message.role) -%}
    {{- '<start_of_turn>' + role + '\\n' + ns.prefix + render_message(message) + '<end_of_turn>\\n' -}}
    {%- set ns.prefix = '' -%}
{%- endfor -%}
{%- if ns.prefix -%}{{- '<start_of_turn>user\\n' + ns.prefix + '<end_of_turn>\\n' -}}{%- endif -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}
"""

# Idefics3 / SmolVLM: "User:<image>text<end_of_utterance>\\nAssistant:"; no space after the colon before an image.
IDEFICS_TEMPLATE = """\
{{- '<|im_start|>' -}}
{%- if ns.system -%}{{- 'System: ' + ns.system + '<end_of_utterance>\\n' -}}{%- endif -%}
{%- for message in loop_messages -%}
    {%- set role = 'user' if message.role == 'tool' else message.role -%}
    {%- set first = message.content[0] if message.content is not string and message.content else none -%}
    {%- set colon = ':' if first and first.type in ('image', 'image_url') else ': ' -%}
    {{- role | capitalize + colon + render_message(message) + '<end_of_utterance>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}
"""
