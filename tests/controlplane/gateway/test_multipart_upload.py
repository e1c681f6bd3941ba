"""The upload form parsed as it arrives: the file part's bytes handed on whatever the chunking,
its fields before or after it, and a form that is not the one expected refused by name."""

import pytest

from controlplane.gateway.multipart_upload import MultipartRefused, UploadForm

CONTENT_TYPE = "multipart/form-data; boundary=b0undary"


def _form() -> UploadForm:
    return UploadForm(CONTENT_TYPE, file_field="file", max_fields=4, max_field_bytes=64)


def _part(name: str, value: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return f"--b0undary\r\ncontent-disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"


def _parse(body: bytes, chunk: int) -> tuple[UploadForm, bytes]:
    form, file_data = _form(), b""
    for start in range(0, len(body), chunk):
        form.feed(body[start : start + chunk])
        file_data += form.take_file_data()
    form.finish()
    return form, file_data


@pytest.mark.parametrize("chunk", [1, 7, 4096])
@pytest.mark.parametrize("purpose_first", [True, False])
def test_the_file_and_its_purpose_come_through_whatever_the_chunking_and_order(chunk, purpose_first):
    data = b"".join(b'{"n": %d}\r\n--b0und\n' % i for i in range(300))  # a near-boundary inside
    parts = [_part("purpose", b"batch"), _part("file", data, "in.jsonl")]
    body = b"".join(parts if purpose_first else parts[::-1]) + b"--b0undary--\r\n"
    form, file_data = _parse(body, chunk)
    assert (form.filename, form.fields, file_data) == ("in.jsonl", {"purpose": "batch"}, data)


def test_the_purpose_is_known_before_the_files_bytes_when_it_comes_first():
    form = _form()
    file_head = _part("file", b"", "in.jsonl")[: -len(b"\r\n")]
    form.feed(_part("purpose", b"batch") + file_head + b"x" * 50)
    assert (form.fields, form.filename, form.take_file_data()) == ({"purpose": "batch"}, "in.jsonl", b"x" * 50)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (_part("file", b"a", "a.jsonl") + _part("file", b"b", "b.jsonl"), "one file"),
        (_part("other", b"a", "a.jsonl"), "one file"),
        (_part("purpose", b"x" * 65), "over 64 bytes"),
        (b"".join(_part(f"f{i}", b"v") for i in range(5)), "Too many fields"),
        (b"--b0undary\r\ncontent-disposition: form-data\r\n\r\nv\r\n", '"name"'),
        (b"not a form at all", "Invalid multipart"),
    ],
)
def test_a_form_other_than_the_one_expected_is_refused(body, message):
    with pytest.raises(MultipartRefused, match=message):
        form = _form()
        form.feed(body + b"--b0undary--\r\n")
        form.finish()


def test_a_body_cut_before_its_closing_boundary_is_refused():
    form = _form()
    form.feed(_part("purpose", b"batch") + _part("file", b"abc", "in.jsonl"))
    with pytest.raises(MultipartRefused, match="closing boundary"):
        form.finish()


@pytest.mark.parametrize(
    ("content_type", "message"),
    [("application/json", "not multipart"), ("multipart/form-data", "Missing boundary")],
)
def test_a_body_that_is_not_a_multipart_form_is_refused_before_it_is_read(content_type, message):
    with pytest.raises(MultipartRefused, match=message):
        UploadForm(content_type, file_field="file", max_fields=4, max_field_bytes=64)
