"""JSON files a user hands chainexec: every way one is wrong is one error naming the file."""

import pytest

from chainexec import userfiles
from chainexec.errors import ChainexecError


@pytest.mark.parametrize("content, needle", [
    (None, "cannot read the file: No such file"),
    (b"x" * (userfiles.MAX_BYTES + 1), "the file is longer than"),
    (b'{"a":\n "\xe9"}', "the file is not UTF-8 text (byte 0xe9 at offset 8)"),
])
def test_a_file_that_cannot_be_read_as_text_is_refused(tmp_path, content, needle):
    path = tmp_path / "f.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ChainexecError) as err:
        userfiles.read(path, "the file")
    assert needle in str(err.value) and str(path) in str(err.value)


def test_a_file_of_the_largest_size_is_read_whole(tmp_path):
    path = tmp_path / "f.json"
    text = "[" + " " * (userfiles.MAX_BYTES - 2) + "]"
    path.write_text(text)
    assert userfiles.read(path, "the file") == text and userfiles.loads(text, "the file", str(path)) == []


@pytest.mark.parametrize("text, needle", [
    ('{"a": 1,\n "a": 2}', "the file: field 'a' is given twice"),
    ('{"a": [{"b": 1, "b": 1}]}', "field 'b' is given twice"),
    ('{"a": 1,\n "b": }', "the file is not JSON: Expecting value"),
    ("[" * 100000 + "]" * 100000, "nests its lists or objects deeper"),
])
def test_json_that_would_lose_a_value_or_cannot_be_parsed_is_refused(text, needle):
    with pytest.raises(ChainexecError) as err:
        userfiles.loads(text, "the file", "f.json")
    assert needle in str(err.value) and "f.json" in str(err.value)


def test_objects_nested_within_the_parsers_depth_load():
    assert userfiles.loads('{"a": [{"b": [1, 2]}, {"c": null}]}', "the file", "f.json") == {"a": [{"b": [1, 2]}, {"c": None}]}
