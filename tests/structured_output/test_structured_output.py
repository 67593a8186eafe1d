"""Structured output with xgrammar: StructuredOutputsParams refuses bad constraints where they are built,
and greedy decoding of the default model (transformers, fp32, CPU) with the manager's bitmask applied
each step gives outputs that parse and validate: 20 JSON schemas with jsonschema, regexes, choices, a
grammar and json_object, all in one batch. The model's logits are padded past the tokenizer's
vocabulary with the largest values of all, so any padded id the bitmask let through would be chosen."""

import json
import re

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

from helpers.tiny_models import one_torch_thread  # noqa: F401  (an autouse fixture)
from micro_vllm import LLM, CompletionOutput, SamplingParams, StructuredOutputsParams
from micro_vllm.structured_output.manager import StructuredOutputGrammar, StructuredOutputManager, apply_grammar_bitmask

MAX_TOKENS = 64
PADDED_IDS = 40  # the model's vocabulary padded past the tokenizer's, as many models ship it


def _object(required: bool = True, **properties: dict) -> dict:
    schema = {"type": "object", "properties": properties}
    return {**schema, "required": list(properties)} if required else schema


def _string(max_length: int = 12) -> dict:
    return {"type": "string", "maxLength": max_length}


def _int(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


def _array(items: dict, min_items: int = 0, max_items: int = 2) -> dict:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


# (prompt, schema): nested objects, enums, arrays, required and optional fields, numbers, booleans.
SCHEMAS = [
    ("Describe a person.", _object(name=_string(), age=_int(0, 120))),
    ("Is Paris a capital?", _object(city=_string(), is_capital={"type": "boolean"})),
    ("Pick a color.", _object(color={"enum": ["red", "green", "blue"]})),
    ("List a few small numbers.", _object(numbers=_array(_int(0, 9), 1, 4))),
    ("Give today's temperature.", _object(celsius={"type": "number", "minimum": -50, "maximum": 50})),
    ("Describe a user account.", _object(user=_object(id=_int(1, 999), active={"type": "boolean"}))),
    ("Make a shopping list.", _object(items=_array(_object(name=_string(8), qty=_int(1, 9)), 1))),
    ("Describe a book.", {**_object(required=False, title=_string(), pages=_int(1, 999)), "required": ["title"]}),
    ("Name some fruits.", _array({"enum": ["apple", "pear", "plum"]}, 1, 3)),
    ("Which API version?", _object(version={"const": 2}, name=_string(6))),
    ("Give a value.", _object(value={"anyOf": [_int(0, 99), {"type": "boolean"}]})),
    ("Where do you live?", _object(address=_object(city=_string(), zip={"type": "string", "pattern": "^[0-9]{5}$"}))),
    ("Give an airport code.", _object(code={"type": "string", "pattern": "^[A-Z]{3}$"})),
    ("Full name, please.", _object(first=_string(10), middle={"type": ["string", "null"], "maxLength": 8})),
    ("When was the Eiffel Tower built?", _object(year=_int(1800, 2100))),
    ("When is the meeting?", _object(date={"type": "string", "format": "date"})),
    ("Give a point.", {
        "$defs": {"point": _object(x=_int(-9, 9), y=_int(-9, 9))}, "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}}, "required": ["start"],
    }),
    ("Is the sky blue?", {"type": "boolean"}),
    ("Tag this ticket.", _object(tags=_array({"enum": ["bug", "ui", "docs"]}), urgent={"type": "boolean"})),
    ("Count and ratio.", _object(count={"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50},
                                 ratio={"type": "number", "exclusiveMinimum": 0, "maximum": 1})),
]
PHONE = r"[0-9]{3}-[0-9]{4}"
CITY = r"[A-Z][a-z]{2,8}"
CAPITALS = ["Paris", "London", "Berlin", 'a "quoted" \\ choice']
SENTIMENTS = ["positive", "negative", "neutral"]
SUM_GRAMMAR = 'root ::= "(" number " + " number ")"\nnumber ::= [1-9] [0-9]?'
SUM_REGEX = r"\([1-9][0-9]? \+ [1-9][0-9]?\)"
OTHERS = [
    ("Give a phone number.", StructuredOutputsParams(regex=PHONE)),
    ("Name a city.", StructuredOutputsParams(regex=CITY)),
    ("What is the capital of France?", StructuredOutputsParams(choice=CAPITALS)),
    ("I love this film! Sentiment?", StructuredOutputsParams(choice=SENTIMENTS)),
    ("Write a sum of two numbers.", StructuredOutputsParams(grammar=SUM_GRAMMAR)),
    ('Reply with {"ok": true} and nothing else.', StructuredOutputsParams(json_object=True)),
]
REQUESTS = [(prompt, StructuredOutputsParams(json=schema)) for prompt, schema in SCHEMAS] + OTHERS


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def manager(tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer, len(tokenizer) + PADDED_IDS, max_num_seqs=len(SCHEMAS) + len(OTHERS),
                                   stop_token_ids=[tokenizer.eos_token_id])


class GrammarBitmask(LogitsProcessor):
    """What the engine does each step, inside transformers' greedy ``generate``: the grammars accept
    the tokens chosen last step, then their bitmask is applied to this step's logits. The logits are
    padded to the manager's vocabulary first, the padded ids scoring above every real token."""

    def __init__(self, manager: StructuredOutputManager, grammars: list[StructuredOutputGrammar], prompt_length: int):
        self.manager, self.grammars, self.prompt_length = manager, grammars, prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_length:
            accept(self.grammars, input_ids[:, -1])
        padding = scores.max() + 1 + torch.arange(self.manager.vocab_size - scores.shape[1], dtype=scores.dtype)
        scores = torch.cat([scores, padding.expand(scores.shape[0], -1)], dim=1)
        apply_grammar_bitmask(scores, self.manager.grammar_bitmask(self.grammars))
        return scores


def accept(grammars: list[StructuredOutputGrammar], tokens: torch.Tensor) -> None:
    for grammar, token in zip(grammars, tokens.tolist()):
        assert grammar.accept_tokens([token]), token


def chat_texts(tokenizer, prompts: list[str]) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in prompts]


def greedy_decode(model, tokenizer, manager, prompts: list[str], grammars: list[StructuredOutputGrammar]) -> list[list]:
    """Each prompt's greedy output token ids under its grammar, up to and including its stop token."""
    batch = tokenizer(chat_texts(tokenizer, prompts), return_tensors="pt", padding=True, padding_side="left")
    prompt_length = batch.input_ids.shape[1]
    with torch.no_grad():
        sequences = model.generate(
            **batch, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id, logits_processor=[GrammarBitmask(manager, grammars, prompt_length)],
        )
    accept(grammars, sequences[:, -1])  # the last step's tokens
    outputs = sequences[:, prompt_length:].tolist()
    return [ids[: ids.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in ids else ids for ids in outputs]


@pytest.fixture(scope="module")
def decoded(model_dir, tokenizer, manager) -> dict[str, str]:
    """Every prompt's constrained greedy output text, from one batched loop."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [prompt for prompt, _ in REQUESTS]
    grammars = [manager.grammar_init(params) for _, params in REQUESTS]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a small batch: one thread spends the least CPU time on it
    try:
        outputs = greedy_decode(model, tokenizer, manager, prompts, grammars)
    finally:
        torch.set_num_threads(threads)
    for prompt, grammar, ids in zip(prompts, grammars, outputs):
        assert grammar.is_terminated(), f"{prompt!r} did not finish in {MAX_TOKENS} tokens: {tokenizer.decode(ids)!r}"
        assert ids[-1] == tokenizer.eos_token_id and all(t < len(tokenizer) for t in ids)  # no padded id got through
    return {prompt: tokenizer.decode(ids[:-1]) for prompt, ids in zip(prompts, outputs)}


@pytest.mark.real_model
@pytest.mark.parametrize(("prompt", "schema"), SCHEMAS, ids=[p for p, _ in SCHEMAS])
def test_json_schema_output_validates(decoded, prompt, schema):
    jsonschema.validate(json.loads(decoded[prompt]), schema)


def check_others(outputs: dict[str, str]) -> None:
    """The outputs of OTHERS' prompts match their constraints."""
    assert re.fullmatch(PHONE, outputs["Give a phone number."])
    assert re.fullmatch(CITY, outputs["Name a city."])
    assert outputs["What is the capital of France?"] in CAPITALS
    assert outputs["I love this film! Sentiment?"] in SENTIMENTS
    assert re.fullmatch(SUM_REGEX, outputs["Write a sum of two numbers."])
    assert isinstance(json.loads(outputs['Reply with {"ok": true} and nothing else.']), dict)


@pytest.mark.real_model
def test_regex_choice_grammar_and_json_object_outputs_match(decoded):
    check_others(decoded)


# field -> (value, the error type, what the message says besides the field and the value)
BAD_PARAMS = [
    ({}, ValueError, "none set; exactly one of json, regex, choice, grammar, json_object"),
    ({"json": {"type": "integer"}, "regex": "a"}, ValueError, "json, regex set; exactly one of"),
    ({"json": "{bad"}, ValueError, "not valid JSON"),
    ({"json": {"type": "strin"}}, ValueError, 'Unsupported type "strin"'),
    ({"json": [1]}, TypeError, "a JSON schema"),
    ({"json": {"type": "object", "required": "a"}}, ValueError, "required must be an array"),
    ({"json": {**_array({"type": "integer"}), "uniqueItems": True}}, ValueError, "without 'uniqueItems'"),
    ({"json": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}}, ValueError, "without 'not'"),
    ({"json": {"type": "string", "format": "color"}}, ValueError, "without 'format': 'color'"),
    ({"json": {"type": "string", "pattern": "a+", "maxLength": 3}}, ValueError, "'maxLength' beside 'pattern'"),
    ({"regex": "a(b"}, ValueError, "The parenthesis is not closed"),
    ({"regex": ""}, ValueError, "a non-empty regular expression"),
    ({"regex": 3}, TypeError, "a non-empty regular expression"),
    ({"regex": "a\x00b"}, ValueError, "without NUL characters"),
    ({"choice": []}, ValueError, "a non-empty list of strings"),
    ({"choice": "yes"}, TypeError, "a non-empty list of strings"),
    ({"choice": ["yes", 1]}, ValueError, "a non-empty list of strings"),
    ({"grammar": "root ::= foo"}, ValueError, 'Rule "foo" is not defined'),
    ({"grammar": 'rot ::= "a"'}, ValueError, 'The root rule with name "root" is not found'),
    ({"grammar": " "}, ValueError, "an EBNF grammar with a 'root' rule"),
    ({"json_object": False}, ValueError, "True (or None, with another constraint set)"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD_PARAMS, ids=[str(k) for k, _, _ in BAD_PARAMS])
def test_bad_params_are_refused_naming_field_and_value(kwargs, error, message):
    with pytest.raises(error) as raised:
        StructuredOutputsParams(**kwargs)
    text = str(raised.value)
    assert message in text
    if len(kwargs) == 1:
        [(name, value)] = kwargs.items()
        assert f"structured_outputs.{name}={value!r}" in text


def test_good_params_are_kept():
    schema = {"type": "object", "properties": {"not": {"type": "string"}}}  # a property may be named "not"
    assert StructuredOutputsParams(json=schema).json is schema
    assert StructuredOutputsParams(json=json.dumps(schema)).schema_text() == json.dumps(schema)
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


@pytest.mark.real_model
def test_bitmask_rows_for_unconstrained_live_and_terminated_requests(tokenizer, manager):
    assert manager.grammar_bitmask([None, None]) is None
    live, done = (manager.grammar_init(StructuredOutputsParams(choice=["yes", "no"])) for _ in range(2))
    assert done.accept_tokens(tokenizer.encode("no") + [tokenizer.eos_token_id]) and done.is_terminated()
    manager.grammar_bitmask([live] * 3)  # the reused buffer's rows now mask: a None row must be rewritten
    logits = torch.zeros(3, manager.vocab_size)
    apply_grammar_bitmask(logits, manager.grammar_bitmask([None, live, done]))
    allowed = torch.isfinite(logits)
    assert allowed[0].all() and allowed[2].all()
    first_tokens = allowed[1].nonzero().flatten().tolist()
    assert first_tokens and all(t < len(tokenizer) for t in first_tokens)
    assert all(any(c.startswith(tokenizer.decode([t])) for c in ("yes", "no")) for t in first_tokens)


@pytest.mark.real_model
def test_accept_tokens_refuses_what_the_grammar_forbids_and_ignores_tokens_after_the_stop(tokenizer, manager):
    grammar = manager.grammar_init(StructuredOutputsParams(regex="[0-9]+"))
    assert not grammar.accept_tokens(tokenizer.encode("abc"))
    assert grammar.accept_tokens(tokenizer.encode("42") + [tokenizer.eos_token_id] + tokenizer.encode("abc"))
    assert grammar.is_terminated()


@pytest.mark.real_model
def test_bitmask_shape_and_row_count_are_checked(tokenizer, manager):
    grammar = manager.grammar_init(StructuredOutputsParams(regex="[0-9]+"))
    with pytest.raises(ValueError, match="max_num_seqs"):
        manager.grammar_bitmask([grammar] * (len(SCHEMAS) + len(OTHERS) + 1))
    bitmask = manager.grammar_bitmask([grammar])
    with pytest.raises(ValueError, match="bitmask has shape"):
        apply_grammar_bitmask(torch.zeros(1, len(tokenizer)), bitmask)  # the tokenizer's width, not the model's


@pytest.mark.gpu
@pytest.mark.real_model
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_on_cuda_masks_as_on_cpu(manager, dtype):
    grammars = [manager.grammar_init(StructuredOutputsParams(json=schema)) for _, schema in SCHEMAS[:4]] + [None]
    bitmask = manager.grammar_bitmask(grammars)
    logits = torch.randn(len(grammars), manager.vocab_size, dtype=dtype)
    on_cuda = logits.cuda()
    apply_grammar_bitmask(logits, bitmask)
    apply_grammar_bitmask(on_cuda, bitmask)
    assert torch.equal(on_cuda.cpu(), logits)
    assert torch.isinf(logits[:4]).any(dim=1).all() and not torch.isinf(logits[4]).any()


# ------------------------------------------------------------------------------ through LLM.generate
#
# The engine runs REQUESTS with the bitmask in the plan, applied by the runner and advanced by the
# scheduler: greedy, it must give the transformers loop's outputs above, token for token.

UNCONSTRAINED = [("Write a haiku about the sea.", SamplingParams(max_tokens=8, temperature=0)),
                 ("Tell me a joke.", SamplingParams(max_tokens=8, temperature=0.8, seed=3))]


def llm_settings(model_dir, **overrides) -> dict:
    return dict(model=str(model_dir), device="cpu", max_model_len=160, attention_backend="sdpa", **overrides)


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(**llm_settings(model_dir)) as llm:
        yield llm


def generate(llm: LLM, requests: list[tuple[str, SamplingParams]]) -> dict[str, CompletionOutput]:
    """Each prompt's output, the prompts given as their chat template's token ids."""
    prompts = [{"prompt_token_ids": llm.engine.tokenizer(text).input_ids}
               for text in chat_texts(llm.engine.tokenizer, [prompt for prompt, _ in requests])]
    outputs = llm.generate(prompts, [params for _, params in requests], use_tqdm=False)
    return {prompt: output.outputs[0] for (prompt, _), output in zip(requests, outputs)}


def constrained(max_tokens: int = MAX_TOKENS, **kwargs) -> list[tuple[str, SamplingParams]]:
    return [(prompt, SamplingParams(max_tokens=max_tokens, structured_outputs=structured, **kwargs))
            for prompt, structured in REQUESTS]


@pytest.mark.real_model
def test_greedy_generate_gives_the_reference_outputs_beside_unconstrained_requests(llm, decoded):
    """Async scheduling on: every constrained output is the reference's and ends with "stop"; the
    unconstrained requests in the same batch (greedy and seeded) give what they give alone. A choice
    under ``ignore_eos`` still stops where its grammar ends."""
    ignore_eos = ("Is the sky blue? Answer yes or no.",
                  SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
    outputs = generate(llm, [UNCONSTRAINED[0], *constrained(temperature=0), ignore_eos, UNCONSTRAINED[1]])
    assert {prompt: outputs[prompt].text for prompt, _ in REQUESTS} == decoded
    assert all(outputs[prompt].finish_reason == "stop" for prompt, _ in REQUESTS)
    answer = outputs[ignore_eos[0]]
    assert answer.text in ("yes", "no") and answer.finish_reason == "stop"
    assert answer.token_ids[-1] == llm.engine.tokenizer.eos_token_id
    alone = generate(llm, UNCONSTRAINED)
    assert all(outputs[prompt].token_ids == alone[prompt].token_ids for prompt, _ in UNCONSTRAINED)
    assert llm.engine.scheduler.structured_output_manager is not None


@pytest.mark.real_model
def test_seeded_sampling_survives_preemption_without_async_scheduling(llm, model_dir):
    """Seeded sampling on a cache too small for the batch, async scheduling off: requests are
    preempted and recomputed, and their grammars go on where they were: the outputs are those of the
    roomy engine with async scheduling, and each matches its constraint. A few of the requests, to
    keep it short: every fourth schema and the others."""
    requests = [(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=i, structured_outputs=so))
                for i, (prompt, so) in enumerate(REQUESTS) if i % 4 == 0 or i >= len(SCHEMAS)]
    expected = generate(llm, requests)
    with LLM(**llm_settings(model_dir, async_scheduling=False, block_size=16, num_blocks=10)) as small:
        preempted = []
        schedule = small.engine.scheduler.schedule

        def logged_schedule():
            plan = schedule()
            preempted.extend(plan.preempted_req_ids)
            return plan

        small.engine.scheduler.schedule = logged_schedule
        outputs = generate(small, requests)
    assert preempted, "the cache must be small enough to preempt"
    assert {p: o.token_ids for p, o in outputs.items()} == {p: o.token_ids for p, o in expected.items()}
    texts = {prompt: output.text for prompt, output in outputs.items()}
    for prompt, schema in SCHEMAS[::4]:
        jsonschema.validate(json.loads(texts[prompt]), schema)
    check_others(texts)
