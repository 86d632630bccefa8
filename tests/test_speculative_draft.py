"""The draft-model proposer on a tiny model: its proposals are the draft's own greedy tokens (the reference: the
model run one token at a time without the proposer, or the engine without speculation), after rejected proposals,
batched, in a tight block pool and at the end of the context; and the vocabulary check a draft model must pass."""

import json
import random
import shutil

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from churon import SamplingParams
from churon.config import EngineConfig
from churon.engine import LLMEngine
from churon.engine.kv_cache import SequenceKVCache
from churon.engine.sequence import Sequence
from churon.engine.speculative.draft import DraftProposer, check_same_vocabulary
from churon.loader import load_model
from churon.tokenizer import from_hf_dir

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_llama_dir):
    return load_model(tiny_llama_dir)[:2]  # the native kernels where built, the reference path otherwise


@pytest.fixture
def model(model_and_tokenizer):
    return model_and_tokenizer[0]


def proposer(model, num_blocks: int = 64) -> DraftProposer:
    return DraftProposer(model, num_blocks, BLOCK_SIZE, model.kv_dtype, model.config.vocab_size)


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(length)]


def greedy(model, token_ids: list[int], k: int) -> list[int]:
    """k greedy tokens of the model after token_ids, one forward per token on a cache of its own."""
    cache = SequenceKVCache(model.config, len(token_ids) + k, BLOCK_SIZE, model.kv_dtype)
    logits = model(torch.tensor(token_ids), 0, cache)
    out: list[int] = []
    while True:
        out.append(int(logits[0, : model.config.vocab_size].numpy().argmax()))
        if len(out) == k:
            return out
        logits = model(torch.tensor(out[-1:]), len(token_ids) + len(out) - 1, cache)


def used_blocks(*num_tokens: int) -> int:
    return sum(-(-n // BLOCK_SIZE) for n in num_tokens)


def test_proposals_are_what_the_draft_model_generates_greedily(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    draft = proposer(model)
    for i, length in enumerate([1, 7, 16, 17, 45]):
        ids = prompt(length, seed=i)
        engine = LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory=4 << 20, block_size=BLOCK_SIZE))
        expected = engine.generate([ids], [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)])[0].token_ids
        seq = Sequence(ids)
        assert draft.propose([(seq, 5)]) == {seq.seq_id: expected}
        assert expected == greedy(model, ids, 5)  # the reference the other tests use
        # the draft has run the prompt and the first four guesses; the fifth is not fed until it is accepted
        assert draft.num_used_blocks == used_blocks(length + 4)
        draft.drop(seq.seq_id)
        assert draft.num_used_blocks == 0


def test_after_a_partly_accepted_proposal_the_next_is_the_greedy_continuation_of_the_new_tokens(model):
    draft = proposer(model)
    seq = Sequence(prompt(30, seed=5))
    # (proposal tokens the target accepts, tokens it then draws itself): its first draw after a rejected guess is
    # another token than the guess; more than one draw is a step or more without proposals (the adaptive length's
    # back-off), where the draft's cache holds guesses well before the sequence's last token
    for accepted, draws in [(2, 1), (0, 1), (4, 1), (1, 3), (3, 1), (0, 4), (4, 1), (4, 3), (0, 1)]:
        proposal = draft.propose([(seq, 4)])[seq.seq_id]
        assert proposal == greedy(model, seq.token_ids, 4)
        assert draft.num_used_blocks == used_blocks(seq.num_tokens + 3)
        for token in proposal[:accepted]:
            seq.append_token(token)
        own = prompt(draws, seed=seq.num_tokens)
        if accepted < len(proposal) and own[0] == proposal[accepted]:
            own[0] = (own[0] + 1) % 380
        for token in own:
            seq.append_token(token)
    # asked again with nothing new: the same proposal, from the cache as it is
    first = draft.propose([(seq, 4)])[seq.seq_id]
    assert draft.propose([(seq, 4)])[seq.seq_id] == first == greedy(model, seq.token_ids, 4)
    draft.drop(seq.seq_id)
    assert draft.num_used_blocks == 0


def test_a_batch_of_sequences_gets_what_each_would_get_alone(model, monkeypatch):
    lengths, ks = [1, 5, 16, 33, 70], [3, 1, 5, 4, 2]
    seqs = [Sequence(prompt(n, seed=10 + i)) for i, n in enumerate(lengths)]
    batched = proposer(model)
    alone = {seq.seq_id: proposer(model) for seq in seqs}
    forwards = []
    forward_batch = model.forward_batch
    monkeypatch.setattr(model, "forward_batch", lambda batch, cache: forwards.append(batch.num_seqs) or forward_batch(batch, cache))
    for step in range(3):
        forwards.clear()
        got = batched.propose(list(zip(seqs, ks)))
        # every sequence's catch-up in one forward, then one per further guess over those still guessing
        assert forwards == [5, 4, 3, 2, 1]
        for seq, k in zip(seqs, ks):
            assert got[seq.seq_id] == alone[seq.seq_id].propose([(seq, k)])[seq.seq_id] == greedy(model, seq.token_ids, k)
        for i, seq in enumerate(seqs):  # sequence i accepts the first (i + step) % k of its proposal
            proposal = got[seq.seq_id]
            accepted = (i + step) % ks[i]
            for token in proposal[:accepted]:
                seq.append_token(token)
            seq.append_token((proposal[accepted] + 1) % 380)
    for seq in seqs:
        batched.drop(seq.seq_id)
    assert batched.num_used_blocks == 0


def test_a_tight_block_pool_shortens_or_withholds_proposals_and_drop_frees_the_blocks(model):
    draft = proposer(model, num_blocks=3)
    long, short = Sequence(prompt(40, seed=20)), Sequence(prompt(10, seed=21))
    # the long one's catch-up takes all three blocks (40 tokens, and 3 guesses to feed fit in them too)
    assert draft.propose([(long, 4), (short, 4)]) == {long.seq_id: greedy(model, long.token_ids, 4), short.seq_id: []}
    assert draft.num_used_blocks == 3
    draft.drop(long.seq_id)
    draft.drop(short.seq_id)  # held nothing
    assert draft.num_used_blocks == 0

    # 46 tokens: 48 slots leave room to feed two guesses, so three are proposed of the five asked for
    seq = Sequence(prompt(46, seed=22))
    assert draft.propose([(seq, 5)]) == {seq.seq_id: greedy(model, seq.token_ids, 3)}
    # grown past the pool, its catch-up cannot have blocks: no proposal, and it gives back the ones it held
    for token in prompt(4, seed=23):
        seq.append_token(token)
    assert draft.propose([(seq, 5)]) == {seq.seq_id: []}
    assert draft.num_used_blocks == 0
    draft.drop(seq.seq_id)
    assert draft.num_used_blocks == 0


def test_proposals_shrink_at_the_end_of_the_context(model):
    context = model.config.context_length
    draft = proposer(model)
    for length in range(context - 5, context + 1):
        seq = Sequence(prompt(length, seed=length))
        expected_len = min(4, context - length)
        proposal = draft.propose([(seq, 4)])[seq.seq_id]
        assert len(proposal) == expected_len
        if expected_len:
            assert proposal == greedy(model, seq.token_ids, expected_len)
        draft.drop(seq.seq_id)
    assert draft.num_used_blocks == 0


def test_a_proposal_ends_at_a_stop_token(model):
    ids = prompt(14, seed=30)  # with the guesses fed before the stop token: one block; with those for six: two
    reference = greedy(model, ids, 6)
    stop = reference[2]
    seq = Sequence(ids, SamplingParams(stop_token_ids=[stop]))
    draft = proposer(model)
    expected = reference[: reference.index(stop) + 1]
    assert draft.propose([(seq, 6)]) == {seq.seq_id: expected}
    # the blocks reserved for the guesses it did not need went back
    assert draft.num_used_blocks == used_blocks(len(ids) + len(expected) - 1)


# --- the vocabulary check -------------------------------------------------------------------------------


def test_the_same_tokenizer_passes_the_vocabulary_check(tiny_llama_dir):
    check_same_vocabulary(from_hf_dir(tiny_llama_dir), from_hf_dir(tiny_llama_dir), "draft-dir")


def test_a_vocabulary_with_one_token_changed_fails_naming_it(tiny_llama_dir, tmp_path):
    target = from_hf_dir(tiny_llama_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_llama_dir / name, tmp_path / name)
    files = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = files["model"]["vocab"]
    by_id = {i: text for text, i in vocab.items()}
    vocab[by_id[100]], vocab[by_id[101]] = 101, 100  # two tokens trade ids: the same tokens, other numbers
    (tmp_path / "tokenizer.json").write_text(json.dumps(files))
    draft = from_hf_dir(tmp_path)
    assert draft.vocab_size == target.vocab_size
    with pytest.raises(ValueError) as e:
        check_same_vocabulary(target, draft, "draft-dir")
    assert str(e.value) == (
        f"draft model draft-dir: its vocabulary differs from the target's: token 100 is {draft.token_bytes(100)!r} in"
        f" the draft, {target.token_bytes(100)!r} in the target model; a draft model must share the target's tokenizer"
    )


def test_a_vocabulary_of_another_size_fails(tiny_llama_dir, tmp_path):
    target = from_hf_dir(tiny_llama_dir)
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_llama_dir / name, tmp_path / name)
    hf = HFTokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    hf.add_tokens(["<|extra|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    draft = from_hf_dir(tmp_path)
    with pytest.raises(ValueError, match=f"its vocabulary has {target.vocab_size + 1} tokens, the target's {target.vocab_size}"):
        check_same_vocabulary(target, draft, "draft-dir")
    with pytest.raises(ValueError, match=f"its vocabulary has {target.vocab_size} tokens, the target's {target.vocab_size + 1}"):
        check_same_vocabulary(draft, target, "draft-dir")


@pytest.mark.parametrize("field", ["eog_ids", "bos_id"])
def test_other_end_of_generation_or_bos_ids_fail(tiny_llama_dir, field):
    target, draft = from_hf_dir(tiny_llama_dir), from_hf_dir(tiny_llama_dir)
    if field == "eog_ids":
        draft.eog_ids = target.eog_ids | {5}
        message = "its end-of-generation tokens"
    else:
        draft.bos_id = 5
        message = f"its BOS token is 5, the target's {target.bos_id}"
    with pytest.raises(ValueError, match=message):
        check_same_vocabulary(target, draft, "draft-dir")
