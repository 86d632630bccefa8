"""The real all-MiniLM-L6-v2 (registry model all-minilm, sentence-transformers' own directory): churon's
vectors against sentence-transformers' on varied sentences, and the same retrieval ranking."""

import pytest
import torch
import torch.nn.functional as F

from churon import LLM, kernels

pytestmark = pytest.mark.slow

TOPICS = {
    "astronomy": [
        "The telescope revealed four moons circling Jupiter.",
        "A supernova can outshine its entire galaxy for weeks.",
        "Light from the Andromeda galaxy left it two and a half million years ago.",
        "Saturn's rings are made mostly of ice and rock.",
        "Astronomers measure stellar distances with parallax.",
    ],
    "cooking": [
        "Knead the dough for ten minutes until it is smooth and elastic.",
        "Sear the steak in a very hot pan, then let it rest.",
        "A pinch of salt makes chocolate taste richer.",
        "Simmer the tomato sauce slowly with garlic and basil.",
        "Whisk the egg whites until stiff peaks form.",
    ],
    "programming": [
        "A hash map gives constant-time lookups on average.",
        "Python's list comprehension builds a new list from an iterable.",
        "The compiler reported a null pointer dereference at line 42.",
        "Git rebase rewrites the commit history of a branch.",
        "Unit tests catch regressions before the code ships.",
    ],
    "football": [
        "The striker scored twice in the second half.",
        "The goalkeeper saved a penalty in the final minute.",
        "The referee showed a red card for a dangerous tackle.",
        "The team won the league after a long unbeaten run.",
        "Offside is judged at the moment the ball is played.",
    ],
    "medicine": [
        "Vaccines train the immune system to recognise a virus.",
        "High blood pressure raises the risk of stroke.",
        "Antibiotics do not work against viral infections.",
        "The surgeon repaired the torn ligament in the knee.",
        "Regular exercise lowers the resting heart rate.",
    ],
    "finance": [
        "Compound interest grows savings faster over decades.",
        "The central bank raised interest rates to curb inflation.",
        "Diversifying a portfolio reduces its risk.",
        "The company's shares fell after weak quarterly earnings.",
        "A mortgage is a loan secured by a house.",
    ],
    "gardening": [
        "Tomatoes need full sun and regular watering.",
        "Prune the roses in late winter before new growth starts.",
        "Compost enriches the soil with organic matter.",
        "Slugs eat young lettuce leaves at night.",
        "Plant tulip bulbs in autumn for spring flowers.",
    ],
    "music": [
        "The orchestra tuned to the oboe's A before the concert.",
        "A minor chord sounds darker than a major one.",
        "She practised the violin sonata every morning.",
        "The drummer kept a steady beat through the whole song.",
        "Jazz musicians often improvise over chord changes.",
    ],
    "travel": [
        "The night train from Vienna arrives in Venice at dawn.",
        "Remember to renew your passport before the trip.",
        "The hostel near the station was cheap and clean.",
        "Our flight was delayed by a storm over the Alps.",
        "Hiking the coastal path takes about three days.",
    ],
    "history": [
        "The Roman Empire split into eastern and western halves.",
        "The printing press spread books across Europe.",
        "The Berlin Wall fell in November 1989.",
        "Ancient Egyptians built the pyramids as royal tombs.",
        "The Magna Carta limited the power of the English king.",
    ],
}
PASSAGES = [s for group in TOPICS.values() for s in group]
QUERIES = [
    "How far away are other galaxies?",
    "How do I make bread at home?",
    "What data structure has fast lookups?",
    "Who scored the goals in the match?",
    "Do antibiotics cure the flu?",
    "Why do interest rates change?",
    "When should I plant flower bulbs?",
    "What instrument sets the tuning of an orchestra?",
    "How do I get from Austria to Italy by rail?",
    "When did the Berlin Wall come down?",
]
SENTENCES = PASSAGES  # 50 varied sentences: ten topics, questions among the queries
NEAR_TIE = 0.01  # cosine scores this close may swap places on the native path


@pytest.fixture(scope="module")
def reference_vectors(minilm_dir):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(minilm_dir), device="cpu")
    return torch.tensor(model.encode(SENTENCES)), torch.tensor(model.encode(QUERIES))


def ranking(queries: torch.Tensor, passages: torch.Tensor) -> list[list[int]]:
    return (queries @ passages.T).argsort(dim=-1, descending=True).tolist()


@pytest.mark.parametrize("kernels_choice, floor", [("reference", 0.99999), ("native", 0.999)])
def test_vectors_and_ranking_equal_sentence_transformers(minilm_dir, reference_vectors, kernels_choice, floor):
    if kernels_choice == "native" and not kernels.native_available():
        pytest.skip(kernels.reason)
    llm = LLM(minilm_dir, kernels=kernels_choice, threads=2)
    assert llm.task == "embed" and llm.embedding_dim == 384 and llm.max_embed_len == 256
    passages, queries = (torch.tensor(llm.embed(x)) for x in (SENTENCES, QUERIES))
    want_passages, want_queries = reference_vectors
    cosine = F.cosine_similarity(passages, want_passages)
    assert cosine.min() >= floor, f"min cosine {cosine.min():.6f}"
    assert F.cosine_similarity(queries, want_queries).min() >= floor
    got, want = ranking(queries, passages), ranking(want_queries, want_passages)
    if kernels_choice == "reference":
        assert got == want
    else:
        # Q8_0 weights and 8-bit activations move scores by a few 1e-3: two passages may swap places only where
        # the reference scores them within NEAR_TIE of each other
        ref, ours = want_queries @ want_passages.T, queries @ passages.T
        ref_gap, our_gap = ref[:, :, None] - ref[:, None, :], ours[:, :, None] - ours[:, None, :]
        swapped = ref_gap * our_gap < 0
        assert ref_gap[swapped].abs().le(NEAR_TIE).all(), ref_gap[swapped].abs().max()
        assert [r[0] for r in got] == [r[0] for r in want]
    # and every query finds a passage of its own topic first
    assert [r[0] // 5 for r in got] == list(range(len(QUERIES)))
