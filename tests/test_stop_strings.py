"""Stop strings in the detokenizer: cut where they start, never emitted, held back while they may be starting."""

from churon.tokenizer import Detokenizer


class PieceTokenizer:
    """Token i decodes to pieces[i]: the detokenizer's text is exactly the pieces fed to it."""

    def __init__(self, pieces):
        self.pieces = list(pieces)

    def decode(self, ids, skip_special_tokens=True, at_start=True):
        return "".join(self.pieces[i] for i in ids)


def feed(stops, pieces):
    detokenizer = Detokenizer(PieceTokenizer(pieces), stop=stops)
    emitted = []
    for token in range(len(pieces)):
        emitted.append(detokenizer.update(token))
        if detokenizer.stopped:
            return emitted, True
    emitted.append(detokenizer.finish())
    return emitted, False


def test_no_stops_passes_text_through():
    assert feed([], ["a", "b"]) == (["a", "b", ""], False)


def test_stop_string_is_cut_and_not_emitted():
    emitted, hit = feed(["END"], ["hello E", "N", "D tail"])
    assert hit and "".join(emitted) == "hello "


def test_possible_stop_prefix_is_held_back_then_released():
    emitted, hit = feed(["</s>"], ["a<", "/x", "y"])
    assert not hit
    assert emitted[0] == "a"  # "<" could start "</s>"
    assert "".join(emitted) == "a</xy"


def test_earliest_of_several_stops_wins():
    emitted, hit = feed(["world", "lo"], ["hello world"])
    assert hit and "".join(emitted) == "hel"


def test_stop_spanning_many_pieces():
    emitted, hit = feed(["\n\nUser:"], ["ok", "\n", "\n", "Us", "er", ":", "more"])
    assert hit and "".join(emitted) == "ok"
