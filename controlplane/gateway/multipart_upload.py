"""A multipart/form-data upload parsed as it arrives: its small fields kept, its one file part's
bytes handed on as they are parsed, never spooled, so an upload is written once, where it goes."""

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header


class MultipartRefused(ValueError):
    """The body is not the multipart form expected; the message says how."""


def _text(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return raw.decode("latin-1")


class UploadForm:
    """Feed it the body's chunks in order. After each, `fields` holds the fields read so far,
    `filename` is set once the file part's headers are read, and `take_file_data()` returns the
    file's bytes parsed since the last call; `finish()` once the body has ended."""

    def __init__(self, content_type: str, *, file_field: str, max_fields: int, max_field_bytes: int):
        kind, options = parse_options_header(content_type)
        if kind != b"multipart/form-data":
            raise MultipartRefused("the body is not multipart/form-data.")
        if not options.get(b"boundary"):
            raise MultipartRefused("Missing boundary in multipart.")
        self._file_field, self._max_fields, self._max_field_bytes = file_field, max_fields, max_field_bytes
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.ended = False
        self._file_data: list[bytes] = []
        self._header_name = self._header_value = self._disposition = b""
        self._part_name = ""
        self._part_is_file = False
        self._part_data = bytearray()
        callbacks = {
            "on_part_begin": self._on_part_begin,
            "on_header_field": self._on_header_field,
            "on_header_value": self._on_header_value,
            "on_header_end": self._on_header_end,
            "on_headers_finished": self._on_headers_finished,
            "on_part_data": self._on_part_data,
            "on_part_end": self._on_part_end,
            "on_end": self._on_end,
        }
        try:
            self._parser = MultipartParser(options[b"boundary"], callbacks)
        except FormParserError as exc:
            raise MultipartRefused(str(exc)) from None

    def feed(self, chunk: bytes) -> None:
        try:
            self._parser.write(chunk)
        except FormParserError:
            raise MultipartRefused("Invalid multipart data.") from None

    def take_file_data(self) -> bytes:
        data = b"".join(self._file_data)
        self._file_data.clear()
        return data

    def finish(self) -> None:
        if not self.ended:
            raise MultipartRefused("the body ended before the form's closing boundary.")

    def _on_part_begin(self) -> None:
        self._disposition, self._part_name, self._part_is_file = b"", "", False
        self._part_data = bytearray()

    def _on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _on_header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_name = self._header_value = b""

    def _on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise MultipartRefused('The Content-Disposition header field "name" must be provided.')
        self._part_name = _text(options[b"name"])
        if b"filename" in options:
            if self._part_name != self._file_field or self.filename is not None:
                raise MultipartRefused(f"send one file, as the field {self._file_field!r}.")
            self.filename, self._part_is_file = _text(options[b"filename"]), True
        elif len(self.fields) >= self._max_fields:
            raise MultipartRefused(f"Too many fields. Maximum number of fields is {self._max_fields}.")

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._part_is_file:
            self._file_data.append(data[start:end])
            return
        if len(self._part_data) + end - start > self._max_field_bytes:
            raise MultipartRefused(f"the field {self._part_name!r} is over {self._max_field_bytes:,} bytes.")
        self._part_data += data[start:end]

    def _on_part_end(self) -> None:
        if not self._part_is_file:
            self.fields[self._part_name] = _text(bytes(self._part_data))

    def _on_end(self) -> None:
        self.ended = True
