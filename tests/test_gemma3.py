"""The real Gemma 3 270M (Q4_K_M GGUF): its tokens against llama.cpp's and transformers', its greedy continuations
against transformers loading the same file (dequantized, fp32), past the 512-token window of its local layers."""

import pytest
import torch

from churon import LLM, SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
TEXTS = [
    "The capital of France is",
    "  leading spaces, tabs\tand\n\nnewlines; café, naïve, 中文, 日本語, emoji 🙂, <b>markup</b>, x²",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
]
# prompt lengths in tokens: a short one, one inside the window, and two past it (the windowed layers then see
# only their last 512 positions, the global ones all)
PROMPT_TOKENS = (6, 300, 700, 1100)
# two logits closer than this are a tie that float rounding may break either way
NEAR_TIE = 0.05
# ... or that the native path's 8-bit activations may: they move the top logits by up to 0.17 on these prompts
# (the largest |native - reference| among the reference's top 5, at the last position of each prompt)
NATIVE_NEAR_TIE = 0.35


@pytest.fixture(scope="module")
def gpl_text():
    from pathlib import Path

    return (Path(__file__).parent / "data" / "GPL-3").read_text()


@pytest.fixture(scope="module")
def reference_llm(gemma3_gguf):
    return LLM(gemma3_gguf, threads=2, kernels="reference")


@pytest.fixture(scope="module")
def llm(gemma3_gguf):
    return LLM(gemma3_gguf, threads=2)


@pytest.fixture(scope="module")
def reference(gemma3_gguf):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name,
                                                              dtype=torch.float32)
    return model.eval()


def prompts(llm, gpl_text):
    """The GPL's first tokens at each length, and a chat turn through the Gemma template."""
    ids = llm.tokenizer.encode(gpl_text)
    chat = llm.chat_prompt_ids([{"role": "user", "content": "What is the capital of France?"}])
    return [ids[:n] for n in PROMPT_TOKENS] + [chat]


def reference_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' own KV-cache loop, argmax each step; the logits of every step."""
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        tokens, logits = [], []
        for _ in range(n):
            logits.append(out.logits[0, -1])
            tokens.append(int(logits[-1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logits


def assert_same_or_near_tie(got: list[int], expected: list[int], logits: list[torch.Tensor], tie: float,
                            what: str) -> None:
    """Equal up to the first difference, which must be where the reference's best two tokens are within tie."""
    for step, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            top = logits[step].topk(2).values
            gap = float(top[0] - top[1])
            assert gap < tie, f"{what}: token {step} differs ({a} vs {b}) where the reference's margin is {gap:.3f}"
            return
    assert len(got) == len(expected)


def test_token_ids_equal_llama_cpp_and_transformers(reference_llm, gemma3_gguf, gpl_text):
    llama_cpp = pytest.importorskip("llama_cpp")
    import transformers

    vocab = llama_cpp.Llama(str(gemma3_gguf), vocab_only=True, verbose=False)
    hf = transformers.AutoTokenizer.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name)
    tok = reference_llm.tokenizer
    for text in TEXTS + [gpl_text[:5000]]:
        ours = tok.encode(text)
        assert ours == vocab.tokenize(text.encode(), add_bos=True, special=True), text[:40]
        assert ours == hf(text)["input_ids"], text[:40]
        if "<start_of_turn>" not in text:  # decoding leaves control tokens out
            assert tok.decode(ours[1:]) == text


def test_greedy_continuations_match_transformers(reference_llm, llm, reference, gpl_text):
    """The exact fp32 path to the token (but a near tie); the native path, on 8-bit activations, too."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for ids in prompts(reference_llm, gpl_text):
        expected, logits = reference_greedy(reference, ids, NEW_TOKENS)
        for name, model, tie in (("reference", reference_llm, NEAR_TIE), ("native", llm, NATIVE_NEAR_TIE)):
            got = model.generate([ids], params, use_tqdm=False)[0].token_ids
            assert_same_or_near_tie(got, expected, logits, tie, f"{name}, {len(ids)}-token prompt")


def test_chat_template_is_gemmas(llm):
    """The file has no template: churon's Gemma fallback renders what llama.cpp's built-in gemma template does."""
    llama_cpp = pytest.importorskip("llama_cpp")
    assert llm.tokenizer.chat_template is None
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": " What is 2+2? "},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    chat = (llama_cpp.llama_chat_message * len(messages))(
        *[llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages])
    buf = bytes(4096)
    n = llama_cpp.llama_chat_apply_template(b"gemma", chat, len(messages), True, buf, len(buf))
    theirs = buf[:n].decode()
    ours = llm.tokenizer.apply_chat_template(messages)
    assert ours == "<bos>" + theirs  # llama.cpp leaves the BOS to the tokenizer


def test_end_of_turn_ends_generation(reference_llm):
    """google/gemma-3-270m is the pretrained model (its chat answers ramble, llama.cpp's as much); its turn ends
    with <end_of_turn> all the same, which must stop a chat."""
    tok = reference_llm.tokenizer
    end_of_turn = tok.encode("<end_of_turn>", add_bos=False)
    assert len(end_of_turn) == 1 and end_of_turn[0] in tok.eog_ids
