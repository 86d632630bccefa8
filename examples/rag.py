"""Retrieval-augmented generation on churon alone, offline.

    python examples/rag.py index DOCS_DIR --store docs.npz      # chunk, embed and store every *.txt / *.md
    python examples/rag.py ask "QUESTION" --store docs.npz [--k 3] [--model smollm2-135m]
    python examples/rag.py ask "QUESTION" --store docs.npz --server http://127.0.0.1:8000/v1
        # the same through `churon serve smollm2-135m --embedding-model all-minilm` (the openai client)

index splits each file into chunks of --words words, each overlapping the previous by --overlap words (so
a sentence cut at a chunk's end is most likely whole in the next one), embeds them with all-MiniLM-L6-v2 and saves the
unit vectors, the chunk texts and their files to one .npz. ask embeds the question with the same model,
takes the k chunks of highest cosine similarity and asks the chat model with them in the prompt.

The store is numpy rather than faiss, sqlite-vec or chromadb: a folder of documents makes a few thousand
chunks, one matrix-vector product over them is an exact cosine ranking in milliseconds, so an approximate
index would add a dependency and nothing else.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import numpy as np

from churon import LLM, SamplingParams

EMBED_MODEL = "all-minilm"
SYSTEM = "Answer the question using only the context. Answer in one short sentence."


def chunk_words(text: str, words: int, overlap: int) -> list[str]:
    """Chunks of `words` words, each starting `words - overlap` words after the previous one."""
    tokens = text.split()
    starts = range(0, max(len(tokens) - overlap, 1), words - overlap)  # no last chunk made of overlap alone
    return [" ".join(tokens[i:i + words]) for i in starts] if tokens else []


def local_models(chat_model: str):
    """(embed, chat) through churon's Python API; the chat model is loaded on first use (index needs none)."""
    embedder = LLM(EMBED_MODEL, task="embed")
    chat_llm = functools.cache(lambda: LLM(chat_model))

    def chat(messages: list[dict], max_tokens: int) -> str:
        return chat_llm().chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens)).text

    return (lambda texts: embedder.embed(texts, truncate=True)), chat


def server_models(url: str, chat_model: str):
    """(embed, chat) through churon serve's /v1/embeddings and /v1/chat/completions."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused")

    def embed(texts: list[str]) -> list[list[float]]:
        vectors = []
        for i in range(0, len(texts), 512):  # a request holds at most 2048 inputs (OpenAI's limit, churon's too)
            # truncate_prompt_tokens=-1 (vLLM's field): cut an over-long chunk to the model's length, as truncate=True
            reply = client.embeddings.create(model=EMBED_MODEL, input=texts[i:i + 512],
                                             extra_body={"truncate_prompt_tokens": -1})
            vectors += [d.embedding for d in reply.data]
        return vectors

    def chat(messages: list[dict], max_tokens: int) -> str:
        reply = client.chat.completions.create(model=chat_model, messages=messages, temperature=0,
                                               max_tokens=max_tokens)
        return reply.choices[0].message.content

    return embed, chat


def index(docs: Path, store: Path, embed, words: int = 120, overlap: int = 30) -> int:
    texts, sources = [], []
    for path in sorted(p for p in docs.rglob("*") if p.suffix in (".txt", ".md") and p.is_file()):
        for chunk in chunk_words(path.read_text(encoding="utf-8", errors="replace"), words, overlap):
            texts.append(chunk)
            sources.append(str(path.relative_to(docs)))
    if not texts:
        raise SystemExit(f"{docs}: no text in any *.txt or *.md file")
    vectors = np.asarray(embed(texts), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)  # unit rows: a dot product is the cosine
    np.savez(store, vectors=vectors, texts=np.array(texts), sources=np.array(sources))
    return len(texts)


def retrieve(store: Path, question: str, embed, k: int) -> list[tuple[float, str, str]]:
    """The k chunks most similar to the question: (cosine, source file, text), best first."""
    data = np.load(store)
    query = np.asarray(embed([question])[0], dtype=np.float32)
    scores = data["vectors"] @ (query / np.linalg.norm(query))
    best = np.argsort(-scores, kind="stable")[:k]
    return [(float(scores[i]), str(data["sources"][i]), str(data["texts"][i])) for i in best]


def build_messages(question: str, hits: list[tuple[float, str, str]]) -> list[dict]:
    context = "\n\n".join(text for _, _, text in hits)
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}"}]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("index", help="chunk, embed and store the *.txt / *.md files under a folder")
    p.add_argument("docs", type=Path)
    p.add_argument("--words", type=int, default=120, help="words per chunk")
    p.add_argument("--overlap", type=int, default=30, help="words shared by consecutive chunks")
    p = sub.add_parser("ask", help="answer a question from the stored chunks")
    p.add_argument("question")
    p.add_argument("--k", type=int, default=3, help="chunks put in the prompt")
    p.add_argument("--model", default="smollm2-135m", help="chat model")
    p.add_argument("--max-tokens", type=int, default=64)
    for p in sub.choices.values():
        p.add_argument("--store", type=Path, required=True, help="the .npz file of vectors and chunks")
        p.add_argument("--server", help="a churon serve URL (http://HOST:PORT/v1) instead of loading the models here")
    args = parser.parse_args(argv)
    if args.command == "index" and not args.docs.is_dir():
        parser.error(f"{args.docs}: not a folder")
    if args.command == "index" and not 0 <= args.overlap < args.words:
        parser.error(f"--overlap {args.overlap} must be at least 0 and less than --words {args.words}")
    if args.command == "ask" and not args.store.is_file():
        parser.error(f"{args.store}: no such store; run `index` first")
    if args.command == "ask" and args.k < 1:
        parser.error(f"--k {args.k} must be at least 1")
    chat_model = getattr(args, "model", "smollm2-135m")
    embed, chat = server_models(args.server, chat_model) if args.server else local_models(chat_model)
    if args.command == "index":
        print(f"{index(args.docs, args.store, embed, args.words, args.overlap)} chunks -> {args.store}")
        return
    hits = retrieve(args.store, args.question, embed, args.k)
    print(chat(build_messages(args.question, hits), args.max_tokens).strip())
    print("sources: " + ", ".join(dict.fromkeys(source for _, source, _ in hits)))


if __name__ == "__main__":
    main()
