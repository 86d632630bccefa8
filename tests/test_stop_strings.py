from churon.engine import StopChecker


def feed(stops, pieces):
    checker = StopChecker(stops)
    emitted = []
    for piece in pieces:
        text, hit = checker.add(piece)
        emitted.append(text)
        if hit:
            return emitted, True
    emitted.append(checker.flush())
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
