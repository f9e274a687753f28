"""A model's chat template is rendered within bounds: what a hostile template would build or
how long it would run is refused in one line (ModelError) before it takes the machine, and a
real template renders exactly as in jinja's plain sandbox."""

from __future__ import annotations

import time

import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from prefixcache.errors import ModelError
from prefixcache.model import template
from prefixcache.model.template import BoundedEnvironment

MESSAGES = [
    {"role": "system", "content": "You sort tickets.  "},
    {"role": "user", "content": "I was charged twice ünïcödé"},
    {"role": "assistant", "content": "billing"},
    {"role": "user", "content": "The app crashes\nwhen I open it"},
]

REAL = {
    "chatml": "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "llama3-like": "{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}"
                   "{% if m['role'] == 'system' %}{% set ns.system = m['content'] | trim %}{% endif %}{% endfor %}"
                   "{% if ns.system %}{{ '<|start_header_id|>system<|end_header_id|>\n\n' ~ ns.system ~ '<|eot_id|>' }}"
                   "{% endif %}{% for m in messages if m['role'] != 'system' %}"
                   "{{ '<|start_header_id|>' ~ m['role'] ~ '<|end_header_id|>\n\n' ~ m['content'] | trim ~ '<|eot_id|>' }}"
                   "{% if loop.last and add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
                   "{% endif %}{% endfor %}",
    "gemma-like": "{% macro turn(role, text) %}<start_of_turn>{{ role }}\n{{ text | trim }}<end_of_turn>\n{% endmacro %}"
                  "{% for m in messages %}{% set role = 'model' if m.role == 'assistant' else m.role %}"
                  "{% if loop.index0 % 2 == 1 and m.role == 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}"
                  "{{ turn(role, m.content) }}{% endfor %}{{ '%s|%d|%.2f' % ('x', 3, 0.5) }}"
                  "{{ '{}: {}'.format('n', messages | length) }}{{ [1, 2, 3] | join(', ') }}{{ {'k': 1} | tojson }}"
                  "{% for i in range(3) %}{{ i }}{% endfor %}{{ ('-' * 3) + 'x'.ljust(4) + ('ab' | replace('a', 'c')) }}",
}


def _environment(kind: type) -> ImmutableSandboxedEnvironment:
    env = kind(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: __import__("json").dumps(value, indent=indent)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env


@pytest.mark.parametrize("name", sorted(REAL))
def test_a_real_template_renders_as_in_the_plain_sandbox(name):
    messages = MESSAGES if name != "gemma-like" else MESSAGES[1:]
    for generation in (False, True):
        plain = _environment(ImmutableSandboxedEnvironment).from_string(REAL[name])
        bounded = _environment(BoundedEnvironment).from_string(REAL[name])
        kwargs = {"messages": messages, "add_generation_prompt": generation, "bos_token": "<s>"}
        assert bounded.render(**kwargs) == plain.render(**kwargs)


HOSTILE = {
    "range beyond the sandbox": "{% for i in range(100000000) %}{% endfor %}",
    "nested ranges": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "repeated string": "{{ 'x' * 2000000000 }}",
    "repeated list": "{{ ['x'] * 2000000000 }}",
    "doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling with +": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "wide filter": "{{ 'x' | center(2000000000) }}",
    "wide method": "{{ 'x'.ljust(2000000000) }}",
    "wide % field": "{{ '%2000000000d' % 1 }}",
    "starred % field": "{{ '%*d' % (2000000000, 1) }}",
    "wide format field": "{{ '{:2000000000}'.format(1) }}",
    "width from format's values": "{{ '{:{}}'.format(1, 2000000000) }}",
    "huge join": "{{ (['x' * 1000000] * 100) | join('') }}",
    "huge replace": "{{ ('x' * 1000000) | replace('', 'y' * 100) }}",
    "huge power": "{{ 10 ** 100000000 }}",
    "doubling macro": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% else %}{{ 'x' * 1000 }}{% endif %}"
                      "{% endmacro %}{{ f(30) }}",
    "power tower": "{{ ((2 ** 1024) ** 1024) ** 1024 }}",
    "repeated squaring": "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "endless recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(1) }}",
    "many values each within bounds": "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
                                      "{% set ns.l = ns.l + [('\U0001F600' * 16000000) ~ i] %}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_template_is_refused_by_a_bound_on_what_it_builds_not_by_the_clock(name):
    with pytest.raises(ModelError, match="the model's chat template .*: refused") as refused:
        _environment(BoundedEnvironment).from_string(HOSTILE[name]).render(messages=MESSAGES)
    assert "did not finish rendering" not in str(refused.value)


def test_what_a_rendering_holds_is_bounded_by_memory(monkeypatch):
    """Values each within the size bound, all kept: the rendering is refused when what it built
    passes the memory bound, and its traced peak stays within about that bound."""
    import tracemalloc

    monkeypatch.setattr(template, "MAX_BYTES", 16 << 20)
    hoarder = ("{% set ns = namespace(l=[]) %}{% for i in range(40) %}"
               "{% set ns.l = ns.l + [('\U0001F600' * 1000000) ~ i] %}{% endfor %}{{ ns.l | length }}")
    tracemalloc.start()
    try:
        with pytest.raises(ModelError, match="built more than 16 MiB of values in one rendering"):
            _environment(BoundedEnvironment).from_string(hoarder).render(messages=MESSAGES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (16 + 3 * 4) << 20  # the bound and the last values built (4 MB each): 160 MB held otherwise
    assert "1000" in _environment(BoundedEnvironment).from_string(REAL["chatml"] + "{{ 10 * 100 }}").render(
        messages=MESSAGES)  # the budget is the rendering's own: the next one starts afresh


def test_a_template_that_runs_too_long_is_interrupted(monkeypatch):
    """Loops over strings are bounded by no count: the watchdog ends the rendering."""
    monkeypatch.setattr(template, "SECONDS", 0.3)
    busy = "{% for c in 'x' * 100000 %}{% for d in 'x' * 100000 %}{% endfor %}{% endfor %}"
    with pytest.raises(ModelError, match="did not finish rendering in 0.3 s"):
        _environment(BoundedEnvironment).from_string(busy).render(messages=MESSAGES)


def test_the_watchdog_never_fires_after_a_rendering_ended(monkeypatch):
    """Many renderings close to their deadline, then time past it: no stray interruption."""
    monkeypatch.setattr(template, "SECONDS", 0.02)
    env = _environment(BoundedEnvironment)
    quick = env.from_string(REAL["chatml"])
    for _ in range(300):
        quick.render(messages=MESSAGES, add_generation_prompt=True)
    time.sleep(0.1)
    assert sum(range(10)) == 45  # still running: nothing was raised here


def test_transformers_renders_chat_templates_within_the_bounds(chat_tokenizer):
    """`install` makes transformers compile templates in the bounded environment (what the
    model's tokenizer renders goes through it)."""
    template.install()
    tok = chat_tokenizer
    kept = tok.chat_template
    try:
        tok.chat_template = "{{ 'x' * 2000000000 }}"
        with pytest.raises(ModelError, match="2,000,000,000 characters"):
            tok.apply_chat_template(MESSAGES, tokenize=False)
    finally:
        tok.chat_template = kept
    assert "I was charged twice" in tok.apply_chat_template(MESSAGES, tokenize=False)
