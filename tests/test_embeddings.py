"""Embedding models end to end in-process: churon's encoder and pooled vectors against transformers and
sentence-transformers, the decoder as an embedder, the engine's batching (bitwise the same vectors whatever
shares a forward), and LLM.embed's inputs and errors."""

import asyncio
import math

import pytest
import torch
import torch.nn.functional as F

from churon import LLM, kernels
from churon.engine.embedding import AsyncEmbeddingEngine
from churon.errors import ContextLengthError, TaskError
from churon.model.batch import PackedBatch
from tiny_models import make_bert_model, make_hf_model, write_bert_gguf

native_only = pytest.mark.skipif(not kernels.native_available(), reason=kernels.reason)

TEXTS = [
    "the quick brown fox jumps over the lazy dog.",
    "hello world",
    "a cat sat on the mat, and the dog was not lazy!",
    "中文 and 日本語 in one text",
    "Café naïve résumé",
    "",
    "morning sea, evening ship: red sail over the town. " * 3,
]


@pytest.fixture(scope="module")
def st_model(tiny_bert_dir):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    return sentence_transformers.SentenceTransformer(str(tiny_bert_dir), device="cpu")


@pytest.fixture(scope="module")
def reference_llm(tiny_bert_dir):
    return LLM(tiny_bert_dir, kernels="reference", threads=1)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def test_encoder_hidden_states_equal_transformers(tiny_bert_dir, reference_llm):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModel.from_pretrained(tiny_bert_dir).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tiny_bert_dir)
    ids = [reference_llm.encode_for_embedding(t) for t in TEXTS]
    assert ids == [hf_tok(t)["input_ids"] for t in TEXTS]
    packed = PackedBatch.build(ids)
    hidden = reference_llm.model.forward(packed)
    for i, row in enumerate(ids):
        with torch.no_grad():
            want = hf(torch.tensor([row])).last_hidden_state[0]
        a, b = packed.seq_starts[i], packed.seq_starts[i + 1]
        assert relative_error(hidden[a:b], want) <= 1e-4, TEXTS[i]
    # the embedding table's rows, as the reference reads them
    assert torch.equal(reference_llm.model.word, hf.embeddings.word_embeddings.weight.detach())


@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooled_vectors_equal_sentence_transformers(tmp_path, pooling, normalize):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    path = make_bert_model(tmp_path / "bert", pooling=pooling, normalize=normalize, seed=3)
    want = torch.tensor(sentence_transformers.SentenceTransformer(str(path), device="cpu").encode(TEXTS))
    llm = LLM(path, kernels="reference", threads=1)
    assert llm.task == "embed" and llm.pooling.mode == pooling and llm.pooling.normalize == normalize
    got = torch.tensor(llm.embed(TEXTS))
    assert got.shape == (len(TEXTS), llm.embedding_dim)
    assert relative_error(got, want) <= 1e-4
    if normalize:
        assert torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-6)


def test_gguf_encoder_equals_the_hf_directory(tiny_bert_dir, reference_llm, tmp_path):
    gguf = write_bert_gguf(tiny_bert_dir, tmp_path / "bert.gguf", "F32")
    llm = LLM(gguf, kernels="reference", threads=1)
    assert llm.task == "embed" and llm.pooling.mode == "mean"
    assert [llm.encode_for_embedding(t) for t in TEXTS] == [reference_llm.encode_for_embedding(t) for t in TEXTS]
    assert relative_error(torch.tensor(llm.embed(TEXTS)), torch.tensor(reference_llm.embed(TEXTS))) <= 1e-5


def cpu_has_bf16_tiles() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read().split()
    except OSError:
        return False


@native_only
def test_native_vectors_are_close_to_the_reference(tiny_bert_dir, tiles_on_off, reference_llm, st_model):
    """The issue's floor for the native path, for both of its matmuls: float weights on the AMX-BF16 tiles (ISA amx,
    where the CPU has them), else Q8_0 weights (quantized at load) against 8-bit activations."""
    llm = LLM(tiny_bert_dir, kernels="native", threads=2)
    got = torch.tensor(llm.embed(TEXTS))
    assert F.cosine_similarity(got, torch.tensor(st_model.encode(TEXTS))).min() >= 0.999
    assert F.cosine_similarity(got, torch.tensor(reference_llm.embed(TEXTS))).min() >= 0.999
    tiles = tiles_on_off == "amx" and cpu_has_bf16_tiles()
    assert llm.model.layers[0].up.layout.startswith("BF16 AMX tiles" if tiles else "Q8_0")


@native_only
@pytest.mark.parametrize("budget", [2048, 40])
def test_a_vector_is_bitwise_the_same_alone_and_in_a_batch(tiny_bert_dir, tiles_on_off, budget):
    """32 inputs of other lengths around it, packed into forwards of up to `budget` tokens, 1 or 2 threads."""
    llm = LLM(tiny_bert_dir, kernels="native", threads=2, max_num_batched_tokens=budget)
    target = "the quick brown fox jumps over the lazy dog."
    others = [" ".join(["hello world sea ship"] * (i % 9 + 1))[: 3 + 5 * i] for i in range(32)]
    alone = llm.embed(target)[0]
    batch = others[:16] + [target] + others[16:]
    together = llm.embed(batch)
    assert together[16] == alone
    assert together == [llm.embed(t)[0] for t in batch]
    single = LLM(tiny_bert_dir, kernels="native", threads=1)
    assert single.embed(target)[0] == alone


def test_forwards_stay_within_the_token_budget(tiny_bert_dir):
    llm = LLM(tiny_bert_dir, kernels="reference", threads=1, max_num_batched_tokens=32)
    sizes = []
    forward = llm.embedder.forward
    llm.embedder.forward = lambda inputs: sizes.append(sum(map(len, inputs))) or forward(inputs)
    ids = [[2] + [40] * n + [3] for n in (5, 10, 20, 60, 1, 1, 30)]
    vectors = llm.embed(ids)
    assert len(vectors) == len(ids)
    # every forward within the budget, except an input longer than it, which runs alone
    assert sizes == [7 + 12, 22, 62, 3 + 3, 32]


def test_inputs_and_their_errors(reference_llm):
    llm = reference_llm
    one = llm.embed("hello world")
    assert len(one) == 1 and len(one[0]) == llm.embedding_dim
    ids = llm.encode_for_embedding("hello world")
    assert ids[0] == llm.tokenizer.bos_id and ids[-1] == llm.tokenizer.eos_id
    assert llm.embed(ids) == one
    # the same input twice, packed into one forward: on the reference path torch's matmul need not give a
    # row the same bits in a batch of another size (1 ulp on an AMX Xeon), so within a tolerance here
    assert torch.allclose(torch.tensor(llm.embed([ids, ids])), torch.tensor(one * 2), rtol=0, atol=1e-6)
    assert llm.embed([]) == []
    assert llm.embed("") == llm.embed([[llm.tokenizer.bos_id, llm.tokenizer.eos_id]])  # BERT embeds "" as [CLS] [SEP]
    # texts (tokenized together) and token ids mixed: each input as its own call embeds it, in order
    texts = ["Hello World", "", "a longer sentence, with punctuation!"]
    mixed = llm.embed([texts[0], ids, texts[1], texts[2]])
    assert llm.encode_batch_for_embedding(texts) == [llm.encode_for_embedding(t) for t in texts]
    assert ids == llm.encode_for_embedding("Hello World")  # its tokenizer lowercases
    alone = [llm.embed(x)[0] for x in (texts[0], ids, texts[1], texts[2])]
    assert torch.allclose(torch.tensor(mixed), torch.tensor(alone), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="token id 99999 is outside the vocabulary"):
        llm.embed([[2, 99999, 3]])
    with pytest.raises(ValueError, match="input is empty"):
        llm.embed([[]])
    with pytest.raises(TaskError, match="cannot generate"):
        llm.generate("hello")
    with pytest.raises(TaskError, match="cannot generate"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_long_inputs_are_refused_unless_truncated(tiny_bert_dir, st_model):
    llm = LLM(tiny_bert_dir, kernels="reference", threads=1)
    assert llm.max_embed_len == 64  # sentence_bert_config.json's max_seq_length
    text = "the quick brown fox " * 40
    with pytest.raises(ContextLengthError, match="more than the 64"):
        llm.embed(text)
    ids = llm.encode_for_embedding(text, truncate=True)
    assert len(ids) == 64 and ids[-1] == llm.tokenizer.eos_id
    # sentence-transformers truncates the same way: the vectors agree
    want = torch.tensor(st_model.encode([text]))
    assert relative_error(torch.tensor(llm.embed(text, truncate=True)), want) <= 1e-4
    with pytest.raises(ContextLengthError):
        llm.embed([[2] * 65])
    assert len(llm.embed([[2] * 65], truncate=True)) == 1


def test_a_generation_model_cannot_embed_and_an_encoder_cannot_generate(tiny_llama_dir, tiny_bert_dir):
    gen = LLM(tiny_llama_dir, kernels="reference", threads=1)
    assert gen.task == "generate"
    with pytest.raises(TaskError, match="task='embed'"):
        gen.embed("hello")
    with pytest.raises(TaskError, match="encoder"):
        LLM(tiny_bert_dir, task="generate", kernels="reference")
    with pytest.raises(ValueError, match="pooling='max'"):
        LLM(tiny_bert_dir, pooling="max", kernels="reference")


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_decoder_as_embedder_pools_its_final_hidden_states(tmp_path, pooling):
    """The Qwen3-Embedding way: the causal model's last hidden state (after its final norm), pooled."""
    transformers = pytest.importorskip("transformers")
    path = make_hf_model("qwen3", tmp_path / "qwen3")
    llm = LLM(path, task="embed", pooling=pooling, kernels="reference", threads=1)
    assert llm.pooling.mode == pooling and llm.pooling.normalize
    hf = transformers.AutoModel.from_pretrained(path).eval()
    prompts = [[5, 17, 42, 99, 3], [7, 8], [250, 11, 300, 8, 19, 23, 77]]
    got = torch.tensor(llm.embed(prompts))
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            h = hf(torch.tensor([ids])).last_hidden_state[0]
        want = F.normalize(h[-1] if pooling == "last" else h.mean(0), dim=-1)
        assert relative_error(got[i], want) <= 1e-4
    assert llm.engine is None  # no KV cache was planned for it


@native_only
def test_a_decoder_embedder_is_batch_invariant(tmp_path):
    llm = LLM(make_hf_model("llama", tmp_path / "llama"), task="embed", kernels="native", threads=2)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 1, 9)]
    assert llm.embed(prompts) == [llm.embed([p])[0] for p in prompts]


def test_concurrent_async_requests_get_their_solo_vectors(tiny_bert_dir, reference_llm):
    llm = LLM(tiny_bert_dir, kernels="native" if kernels.native_available() else "reference", threads=2,
              max_num_batched_tokens=48)
    engine = AsyncEmbeddingEngine(llm.embedder)
    requests = [[llm.encode_for_embedding(t) for t in TEXTS[i:] + TEXTS[:i]] for i in range(len(TEXTS))]
    forwards = []
    forward = llm.embedder.forward
    llm.embedder.forward = lambda inputs: forwards.append(len(inputs)) or forward(inputs)

    async def main():
        cancelled = asyncio.ensure_future(engine.embed([[2] * 60] * 50))
        await asyncio.sleep(0)
        cancelled.cancel()
        return await asyncio.gather(*(engine.embed(r) for r in requests))

    try:
        results = asyncio.run(main())
        with pytest.raises(ContextLengthError):
            asyncio.run(engine.embed([[2] * 65]))
    finally:
        engine.shutdown()
    llm.embedder.forward = forward
    for r, got in zip(requests, results):
        assert got == llm.embed(r)
    # the cancelled request's 50 inputs were not all run, and the others shared forwards
    assert sum(forwards) < 50 + sum(map(len, requests))
    assert max(forwards) > 1 and all(not math.isnan(x) for v in results[0] for x in v)


def test_the_end_token_is_the_post_processors_even_when_the_config_names_another_eos(tmp_path):
    """Qwen3-Embedding's tokenizer ends every text with <|endoftext|> while its config's EOS is <|im_end|>:
    its last-token pooling reads <|endoftext|>, so churon must append that one, as transformers does."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from churon.tokenizer import from_hf_dir

    vocab = {"a": 0, "b": 1, "<|endoftext|>": 2, "<|im_end|>": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", 2)])
    tok.add_special_tokens(["<|endoftext|>", "<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}')
    want = transformers.AutoTokenizer.from_pretrained(tmp_path)("a b")["input_ids"]
    ours = from_hf_dir(tmp_path)
    assert want == [0, 1, 2] and ours.encode("a b") == want
    assert ours.eos_id == 3 and ours.encode("a b", add_eos=False) == [0, 1]


def test_a_caller_that_gave_up_does_not_stop_the_engine(tiny_bert_dir):
    """A request whose event loop is gone by the time its vectors come (a timed-out asyncio.run) is skipped;
    the engine's thread goes on serving the next ones."""
    import threading

    llm = LLM(tiny_bert_dir, kernels="reference", threads=1)
    engine = AsyncEmbeddingEngine(llm.embedder)
    release = threading.Event()
    forward = llm.embedder.forward
    llm.embedder.forward = lambda inputs: release.wait(30) and forward(inputs)

    async def give_up():
        await asyncio.wait_for(engine.embed([[2, 40, 3]]), 0.05)

    try:
        with pytest.raises(TimeoutError):
            asyncio.run(give_up())
        release.set()  # the forward ends after its caller's loop has closed
        assert asyncio.run(engine.embed([[2, 41, 3]])) == llm.embed([[2, 41, 3]])
    finally:
        engine.shutdown()


def test_token_ids_must_be_integers(reference_llm):
    for bad in ([2, True, 3], [2, 4.0, 3], [2, "5", 3]):
        with pytest.raises(ValueError, match="is not an integer"):
            reference_llm.embed([bad])


def test_texts_are_lowered_where_the_model_says_so(tmp_path):
    # sentence_bert_config.json's do_lower_case: sentence-transformers lowers texts before its (here case-sensitive)
    # tokenizer sees them; so does churon, one text or many
    path = make_hf_model("llama", tmp_path / "llama")
    (path / "modules.json").write_text('[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.'
                                       'Transformer"}, {"idx": 1, "name": "1", "path": "1_Pooling", "type": '
                                       '"sentence_transformers.models.Pooling"}]')
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text('{"word_embedding_dimension": 64, "pooling_mode_mean_tokens": true}')
    (path / "sentence_bert_config.json").write_text('{"max_seq_length": 100, "do_lower_case": true}')
    llm = LLM(path, task="embed", kernels="reference", threads=1)
    texts = ["Hello World", "MiXeD CaSe words"]
    lowered = [llm.tokenizer.encode(t.lower()) for t in texts]
    assert lowered != [llm.tokenizer.encode(t) for t in texts]
    assert [llm.encode_for_embedding(t) for t in texts] == lowered
    assert llm.encode_batch_for_embedding(texts) == lowered
    assert llm.embed(texts) == llm.embed(lowered)
