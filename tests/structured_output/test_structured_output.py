"""Structured output with xgrammar: StructuredOutputsParams refuses bad constraints where they are built,
and greedy decoding of the default model (transformers, fp32, CPU) with the manager's bitmask applied
each step gives outputs that parse and validate: 20 JSON schemas with jsonschema, regexes, choices, a
grammar and json_object, all in one batch. The model's logits are padded past the tokenizer's
vocabulary with the largest values of all, so any padded id the bitmask let through would be chosen.

Then the same requests through ``LLM.generate``: greedy, the engine gives that loop's outputs beside
unconstrained requests it leaves alone; seeded sampling survives preemption without async scheduling;
the Triton sampler route, abort, a failed step and bad input."""

import dataclasses
import itertools
import json

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

from helpers.structured_output import (
    MAX_TOKENS,
    OTHERS,
    REQUESTS,
    SCHEMAS,
    array,
    chat_prompt_ids,
    chat_texts,
    check_all,
    check_others,
    generate,
)
from helpers.fault_workload import record_preemptions
from helpers.tiny_models import make_tiny_model, one_torch_thread  # noqa: F401  (an autouse fixture)
from micro_vllm import LLM, SamplingParams, StructuredOutputsParams
from micro_vllm.sampling.sampler import apply_grammar_bitmask as sampler_mask
from micro_vllm.structured_output.manager import StructuredOutputGrammar, StructuredOutputManager, apply_grammar_bitmask

PADDED_IDS = 40  # the model's vocabulary padded past the tokenizer's, as many models ship it


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
    ({"json": {**array({"type": "integer"}), "uniqueItems": True}}, ValueError, "without 'uniqueItems'"),
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


def test_the_samplers_mask_is_xgrammars():
    """The Sampler masks the logits with the plan's bitmask in PyTorch (so that only structured-output
    requests need xgrammar): what xgrammar's kernel masks, over a width that is no multiple of 32."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 70, generator=generator)
    bitmask = torch.randint(0, 2**32, (5, 3), dtype=torch.int64, generator=generator).to(torch.int32)
    bitmask[0], bitmask[1] = -1, 0  # every token, none
    expected = logits.clone()
    apply_grammar_bitmask(expected, bitmask)
    sampler_mask(logits, bitmask)
    assert torch.equal(logits, expected) and torch.isinf(logits[1]).all() and torch.isfinite(logits[0]).all()


@pytest.mark.gpu
@pytest.mark.real_model
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_on_cuda_masks_as_on_cpu(manager, dtype):
    grammars = [manager.grammar_init(StructuredOutputsParams(json=schema)) for _, schema in SCHEMAS[:4]] + [None]
    bitmask = manager.grammar_bitmask(grammars)
    logits = torch.randn(len(grammars), manager.vocab_size, dtype=dtype)
    on_cuda, by_the_sampler = logits.cuda(), logits.cuda()
    apply_grammar_bitmask(logits, bitmask)
    apply_grammar_bitmask(on_cuda, bitmask)
    sampler_mask(by_the_sampler, bitmask)
    assert torch.equal(on_cuda.cpu(), logits) and torch.equal(by_the_sampler.cpu(), logits)
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


@pytest.mark.real_model
def test_greedy_generate_gives_the_reference_outputs_beside_unconstrained_requests(llm, decoded):
    """Async scheduling on: every constrained output is the reference's and ends with "stop"; the
    unconstrained requests in the same batch (greedy and seeded) give what they give alone. A choice
    under ``ignore_eos`` still stops where its grammar ends."""
    ignore_eos = ("Is the sky blue? Answer yes or no.",
                  SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
    constrained = [(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_outputs=so))
                   for prompt, so in REQUESTS]
    outputs = generate(llm, [UNCONSTRAINED[0], *constrained, ignore_eos, UNCONSTRAINED[1]])
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
    roomy engine with async scheduling, and each that ended matches its constraint (one that
    MAX_TOKENS cut holds what its grammar accepted so far: the engine refuses any other token). A few
    of the requests, to keep it short: every fourth schema and the others."""
    requests = [(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=i, structured_outputs=so))
                for i, (prompt, so) in enumerate(REQUESTS) if i % 4 == 0 or i >= len(SCHEMAS)]
    expected = generate(llm, requests)
    with LLM(**llm_settings(model_dir, async_scheduling=False, block_size=16, num_blocks=10)) as small:
        preempted = record_preemptions(small)
        outputs = generate(small, requests)
    assert preempted, "the cache must be small enough to preempt"
    assert {p: o.token_ids for p, o in outputs.items()} == {p: o.token_ids for p, o in expected.items()}
    check_all({prompt: output.text for prompt, output in outputs.items() if output.finish_reason == "stop"})


@pytest.mark.real_model
def test_logprobs_are_the_models_before_the_grammar_mask(llm):
    """A constrained request's logprobs are the model's (vLLM's raw logprobs), taken before the
    grammar's mask: finite also for the top tokens the grammar forbids, so the server's JSON can carry
    them, and those of an unconstrained request given the same tokens (the prompt logprobs of the
    prompt followed by the constrained output). A choice, whose grammar forbids almost every token."""
    tokenizer = llm.engine.tokenizer
    prompt = chat_prompt_ids(tokenizer, "Is the sky blue? Answer yes or no.")
    choice = StructuredOutputsParams(choice=["yes", "no"])
    [constrained] = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, logprobs=5,
                                                          structured_outputs=choice), use_tqdm=False)
    completion = constrained.outputs[0]
    assert completion.text in ("yes", "no")
    [plain] = llm.generate([prompt + completion.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=5),
                           use_tqdm=False)
    for i, position in enumerate(completion.logprobs):
        expected = plain.prompt_logprobs[len(prompt) + i]
        assert set(position) == set(expected)
        for token_id, entry in position.items():
            assert entry.logprob == pytest.approx(expected[token_id].logprob, abs=1e-4) and entry.rank == expected[token_id].rank
    first = completion.logprobs[0]
    forbidden = [t for t in first if not any(c.startswith(tokenizer.decode([t])) for c in choice.choice)]
    assert forbidden and all(first[t].logprob > -float("inf") for t in forbidden)


SHORT = [(prompt, SamplingParams(max_tokens=12, temperature=0, structured_outputs=so))
         for prompt, so in OTHERS[:3]]  # two regexes and a choice: a few tokens each


@pytest.mark.real_model
def test_the_triton_sampler_route_samples_under_the_grammar(model_dir, decoded):
    """custom_ops "+sampler" (the Triton sampler, interpreted on CPU) reads the masked logits."""
    with LLM(**llm_settings(model_dir, custom_ops=["+sampler"])) as llm:
        outputs = generate(llm, SHORT)
    assert {prompt: output.text for prompt, output in outputs.items()} == {p: decoded[p] for p, _ in SHORT}


@pytest.mark.real_model
def test_abort_and_a_failed_step_drop_the_grammars(llm, decoded, monkeypatch):
    """An aborted request leaves the others' grammars alone; a step that raises aborts them all, and
    the same requests then give the same outputs again: no grammar state outlives its request."""
    engine = llm.engine
    aborted_prompt = SHORT[0][0]
    for prompt, params in SHORT:
        engine.add_request(prompt, chat_prompt_ids(engine.tokenizer, prompt), params)
    finished = {}
    for step in itertools.count():
        if step == 2:
            [aborted] = engine.abort_request(aborted_prompt)
            assert aborted.outputs[0].finish_reason == "abort"
        finished.update((output.request_id, output.outputs[0].text) for output in engine.step() if output.finished)
        if not engine.has_unfinished_requests():
            break
    assert finished == {p: decoded[p] for p, _ in SHORT[1:]}

    execute_model = engine.executor.execute_model
    calls = itertools.count()
    monkeypatch.setattr(engine.executor, "execute_model",
                        lambda plan: execute_model(plan) if next(calls) != 3 else 1 / 0)
    with pytest.raises(ZeroDivisionError):
        generate(llm, SHORT)
    assert not engine.has_unfinished_requests() and not engine.in_flight
    monkeypatch.undo()
    assert {p: o.text for p, o in generate(llm, SHORT).items()} == {p: decoded[p] for p, _ in SHORT}


def test_structured_outputs_is_refused_before_any_work(tmp_path):
    """A constraint for a model without a tokenizer fails before anything is queued (a constraint of
    the wrong type fails in SamplingParams: test_validation.py); requests without a constraint never
    build the structured-output manager."""
    model = make_tiny_model("llama", tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    with LLM(model=str(model), device="cpu", max_model_len=32) as llm:
        params = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
        with pytest.raises(ValueError, match=r"structured_outputs=.* is not allowed: this model has no tokenizer"):
            llm.generate([[1, 2], [3, 4]], [SamplingParams(max_tokens=2), params], use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
        llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert llm.engine.structured_output_manager is None


def test_structured_outputs_needs_an_eos_token(tmp_path, tokenizer):
    """A model without any EOS id (none in its configs or tokenizer) refuses constraints before
    anything is queued, naming why: a grammar's output ends only at an EOS token. The manager refuses
    an empty set of stop ids itself."""
    model = make_tiny_model("llama", tmp_path, eos_token_id=None)
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    del tokenizer_config["eos_token"]
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with LLM(model=str(model), device="cpu", max_model_len=32) as llm:
        assert not llm.engine.eos_token_ids
        params = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
        with pytest.raises(ValueError, match=r"structured_outputs=.* is not allowed: this model has no EOS token id"):
            llm.generate([[1, 2], [3, 4]], [SamplingParams(max_tokens=2), params], use_tqdm=False)
        assert not llm.engine.has_unfinished_requests() and llm.engine.structured_output_manager is None
        assert len(llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match=r"stop_token_ids=\[\] is not allowed"):
        StructuredOutputManager(tokenizer, len(tokenizer), max_num_seqs=1, stop_token_ids=[])


@pytest.mark.real_model
def test_each_sequence_of_an_n_request_follows_its_own_grammar(llm):
    """n > 1 under a schema: every sequence validates, and sequence i is the prompt as a request of its
    own with seed + i (each has a matcher of its own: a shared one would see every sequence's tokens).
    The single requests run in the same batch as the n request, on other rows: a seeded draw depends
    on its seed, not on its row."""
    prompt, schema = SCHEMAS[6]  # a shopping list: long enough for the sequences to differ
    text = chat_texts(llm.engine.tokenizer, [prompt])[0]
    params = SamplingParams(n=3, max_tokens=MAX_TOKENS, temperature=1.0, seed=7,
                            structured_outputs=StructuredOutputsParams(json=schema))
    output, *singles = llm.generate([text] * 4, [params] + [dataclasses.replace(params, n=1, seed=7 + i)
                                                            for i in range(3)], use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    for completion, single in zip(output.outputs, singles):
        jsonschema.validate(json.loads(completion.text), schema)
        assert completion.token_ids == single.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1


@pytest.mark.real_model
def test_the_grammar_wins_where_token_bans_leave_no_token_it_allows(llm):
    """Bans beside a grammar can leave a row no token to sample: ``min_tokens`` holding back EOS where
    the grammar allows only EOS, ``allowed_token_ids`` outside every token the grammar allows, bad words
    on its choices. The row then samples under the grammar's mask alone: each output is a choice, ends
    with "stop", and the unconstrained request of the same steps gives what it gives alone."""
    tokenizer = llm.engine.tokenizer
    prompt = chat_texts(tokenizer, ["Is the sky blue? Answer yes or no."])[0]
    choice = StructuredOutputsParams(choice=["yes", "no"])
    banned = [SamplingParams(max_tokens=8, temperature=0, min_tokens=6, structured_outputs=choice),
              SamplingParams(max_tokens=8, temperature=0, allowed_token_ids=[tokenizer.eos_token_id],
                             structured_outputs=choice),
              SamplingParams(max_tokens=8, temperature=0.8, seed=1, bad_words=["yes", "no", " yes", " no"],
                             structured_outputs=choice)]
    outputs = llm.generate([UNCONSTRAINED[0][0]] + [prompt] * len(banned), [UNCONSTRAINED[0][1], *banned],
                           use_tqdm=False)
    for output in outputs[1:]:
        assert output.outputs[0].text in ("yes", "no") and output.outputs[0].finish_reason == "stop"
    [alone] = llm.generate([UNCONSTRAINED[0][0]], UNCONSTRAINED[0][1], use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == alone.outputs[0].token_ids
