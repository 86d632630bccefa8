"""examples/rag.py: chunking, and the whole loop (index a folder, retrieve, answer) on the real all-MiniLM-L6-v2
and SmolLM2-135M-Instruct, on files whose answer only the retrieved chunk holds."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "rag.py"


def _rag():
    spec = importlib.util.spec_from_file_location("rag", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chunks_overlap_and_cover_every_word():
    rag = _rag()
    words = [f"w{i}" for i in range(25)]
    chunks = rag.chunk_words(" ".join(words), words=10, overlap=3)
    assert chunks == [" ".join(words[0:10]), " ".join(words[7:17]), " ".join(words[14:24]), " ".join(words[21:25])]
    assert rag.chunk_words("a b c", words=10, overlap=3) == ["a b c"]
    assert rag.chunk_words(" \n ", words=10, overlap=3) == []
    # the last chunk is not one made of the previous chunk's overlap alone
    assert rag.chunk_words(" ".join(words[:17]), words=10, overlap=3) == [" ".join(words[0:10]), " ".join(words[7:17])]


DOCS = {
    "lighthouse.txt": (
        "The Blue Harbor lighthouse stands on a granite point at the mouth of the bay. It was built in 1871 from "
        "stone quarried on the island, and its lamp was first lit with whale oil, later with kerosene, and since "
        "1938 with electricity. The tower is forty meters tall and its light can be seen from twenty nautical "
        "miles away on a clear night. Ships entering the harbor keep the light on their left side to avoid the "
        "shoals to the north. The keeper lives in a small white cottage beside the tower. "
        "The Blue Harbor lighthouse keeper's cat is named Pemberton. "
        "Every morning the keeper climbs the one hundred and twelve steps to clean the lens and wind the clock "
        "that turns it. In winter storms the waves reach the gallery, and the keeper writes the wind speed, the "
        "height of the waves and the passing ships in a logbook that has been kept without a gap since the tower "
        "opened. Visitors may climb the tower on Sundays in summer."
    ),
    "sourdough.md": (
        "# Sourdough bread\n\nA sourdough starter is a mixture of flour and water in which wild yeast and lactic "
        "acid bacteria live. Feed it every day with equal weights of flour and water. To bake a loaf, mix the "
        "active starter with flour, water and salt, let the dough rest, then fold it every half hour for two hours. "
        "Shape the loaf, let it rise slowly in the refrigerator overnight, and bake it in a covered pot at a high "
        "temperature. The long fermentation gives the bread its sour taste and open crumb."
    ),
    "volcanoes.txt": (
        "A volcano is an opening in the crust of a planet through which molten rock, ash and gases escape. "
        "Shield volcanoes such as those of Hawaii have gentle slopes built by runny lava flows. Stratovolcanoes "
        "are steep cones of alternating lava and ash layers and erupt explosively. Magma that reaches the surface "
        "is called lava. Many volcanoes lie along the edges of tectonic plates, in the ring of fire around the "
        "Pacific Ocean."
    ),
    "chess.md": (
        "# Chess openings\n\nThe opening is the first phase of a chess game. Good openings develop the knights "
        "and bishops quickly, control the center squares and castle the king to safety. The Sicilian Defence "
        "answers the king's pawn opening with the c-pawn. The Queen's Gambit offers a pawn to gain control of "
        "the center. Beginners should learn principles rather than long memorized lines."
    ),
    "python_lists.txt": (
        "In Python a list is an ordered, mutable collection. Append adds an item at the end, insert places one "
        "at a position, and pop removes and returns an item. Slicing with a colon copies part of a list. A list "
        "comprehension builds a new list from an iterable in one expression. Sorting in place uses the sort "
        "method, while the sorted function returns a new list."
    ),
}
QUESTION = "What is the name of the lighthouse keeper's cat?"


def _run(*args):
    result = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """DOCS indexed in 60-word chunks: the lighthouse file is four, two of which name the cat; the others two each."""
    docs = tmp_path_factory.mktemp("docs")
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    store = tmp_path_factory.mktemp("store") / "store.npz"
    out = _run("index", str(docs), "--store", str(store), "--words", "60", "--overlap", "15")
    assert out.startswith(f"{sum(len(_rag().chunk_words(t, 60, 15)) for t in DOCS.values())} chunks"), out
    return store


@pytest.mark.slow
def test_index_then_ask_answers_from_the_retrieved_file(store):
    from churon import LLM

    rag = _rag()
    embedder = LLM(rag.EMBED_MODEL, task="embed")
    hits = rag.retrieve(store, QUESTION, lambda texts: embedder.embed(texts, truncate=True), k=3)
    assert hits[0][1] == "lighthouse.txt" and "Pemberton" in hits[0][2], hits

    answer, sources = _run("ask", QUESTION, "--store", str(store), "--k", "3").strip().rsplit("\n", 1)
    assert sources.startswith("sources: lighthouse.txt"), sources
    assert "Pemberton" in answer, answer


@pytest.mark.slow
def test_ask_through_churon_serve_gives_the_same_answer(store, smollm2_gguf):
    from test_server import MODEL, start_server, stop_server

    proc, url = start_server(smollm2_gguf, "--embedding-model", _rag().EMBED_MODEL)
    try:
        remote = _run("ask", QUESTION, "--store", str(store), "--k", "3", "--model", MODEL, "--server", f"{url}/v1")
    finally:
        stop_server(proc)
    assert remote == _run("ask", QUESTION, "--store", str(store), "--k", "3")
