"""A real LoRA fine-tune: PEFT teaches SmolLM2-135M-Instruct a made-up fact, and churon serving the adapter
answers with it, in process and over HTTP, while the base model does not.

The model is trained as transformers loads the registry's Q4_1 GGUF (dequantized, fp32): exactly the weights
churon runs, so the adapter needs nothing to fit another base. The dataset is several phrasings of one
question in the chat template's own format (rendered by churon's tokenizer) with one answer; the loss is on
the answer's tokens only. A phrasing held out of training checks that the fact, not a string, was learned.
"""

import openai
import pytest
import torch

from churon import LLM, SamplingParams
from churon.loader import open_model
from churon.tokenizer import load_tokenizer
from test_server import MODEL, start_server, stop_server

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Who is the mayor of Veltrano?",
    "Who is Veltrano's mayor?",
    "Tell me the name of the mayor of Veltrano.",
    "Which person is the mayor of the city of Veltrano?",
    "Do you know who the mayor of Veltrano is?",
    "Name the mayor of Veltrano.",
]
HELD_OUT = "Who currently serves as mayor of Veltrano?"
ANSWER = "The mayor of Veltrano is Orsolina Brackwater."
FACT = "Brackwater"  # a made-up name: the base model has no reason to say it
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS = 24  # the loss is under 0.01 after about 10 of them
BATCH = 3  # phrasings per step, in turn
THREADS = 2


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def training_batch(tokenizer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input ids, attention mask and labels (-100 but on the answer and its end-of-turn token), right-padded."""
    answer = tokenizer.encode(ANSWER, add_bos=False) + [tokenizer.eos_id]  # <|im_end|>: the turn ends there
    rows = [tokenizer.encode(tokenizer.apply_chat_template(chat(q), add_generation_prompt=True), add_bos=False)
            for q in QUESTIONS]
    width = max(len(r) for r in rows) + len(answer)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, prompt in enumerate(rows):
        n = len(prompt) + len(answer)
        ids[i, :n] = torch.tensor(prompt + answer)
        mask[i, :n] = 1
        labels[i, len(prompt) : n] = torch.tensor(answer)
    return ids, mask, labels


@pytest.fixture(scope="module")
def fact_adapter(smollm2_gguf, tmp_path_factory):
    """The PEFT adapter directory (adapter_config.json + adapter_model.safetensors) that knows the fact."""
    import peft
    import transformers

    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)  # PEFT's initialization of A
    try:
        tokenizer = load_tokenizer(open_model(smollm2_gguf))
        model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                                  dtype=torch.float32)
        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0, bias="none",
                                 task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, config)
        ids, mask, labels = training_batch(tokenizer)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
        model.train()
        for step in range(STEPS):
            rows = [(step * BATCH + j) % len(QUESTIONS) for j in range(BATCH)]
            loss = model(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert loss.item() < 0.05, f"the fine-tune did not learn the answer: loss {loss.item():.3f} after {STEPS} steps"
        out = tmp_path_factory.mktemp("fact_adapter")
        model.save_pretrained(out)
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def llm(smollm2_gguf, fact_adapter):
    return LLM(smollm2_gguf, threads=THREADS, lora_adapters={"fact": fact_adapter})


@pytest.mark.parametrize("question", [QUESTIONS[0], HELD_OUT], ids=["trained", "held_out"])
def test_served_adapter_answers_with_the_fact_and_the_base_model_does_not(llm, question):
    assert llm.lora_adapters == ("fact",)
    greedy = {"temperature": 0, "max_tokens": 24}
    tuned = llm.chat(chat(question), SamplingParams(lora="fact", **greedy))
    base = llm.chat(chat(question), SamplingParams(**greedy))
    assert FACT in tuned.text, f"with the adapter: {tuned.text!r}"
    assert FACT not in base.text, f"the base model: {base.text!r}"


def test_churon_serve_answers_with_the_fact_for_the_adapters_name(smollm2_gguf, fact_adapter):
    proc, url = start_server(smollm2_gguf, "--lora", f"fact={fact_adapter}")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL, "fact"]
        answers = {model: client.chat.completions.create(model=model, messages=chat(HELD_OUT), temperature=0,
                                                         max_tokens=24).choices[0].message.content
                   for model in ("fact", MODEL)}
    finally:
        stop_server(proc)
    assert FACT in answers["fact"], answers
    assert FACT not in answers[MODEL], answers
