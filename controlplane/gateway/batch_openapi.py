"""The Files and Batch APIs' part of the /v1 OpenAPI document (openapi.py merges it in)."""

JSON = "application/json"

_FILE = {
    "type": "object",
    "required": ["id", "object", "bytes", "created_at", "filename", "purpose"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "file"},
        "bytes": {"type": "integer", "minimum": 0},
        "created_at": {"type": "integer"},
        "filename": {"type": "string"},
        "purpose": {"enum": ["batch", "batch_output"]},
        "status": {"type": "string"},
    },
}
_COUNTS = {
    "type": "object",
    "required": ["total", "completed", "failed"],
    "properties": {name: {"type": "integer", "minimum": 0} for name in ("total", "completed", "failed")},
}
_BATCH = {
    "type": "object",
    "required": ["id", "object", "endpoint", "input_file_id", "completion_window", "status", "request_counts"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "batch"},
        "endpoint": {"type": "string"},
        "input_file_id": {"type": "string"},
        "completion_window": {"const": "24h"},
        "status": {
            "enum": [
                "validating",
                "failed",
                "in_progress",
                "finalizing",
                "completed",
                "expired",
                "cancelling",
                "cancelled",
            ]
        },
        "output_file_id": {"type": ["string", "null"]},
        "error_file_id": {"type": ["string", "null"]},
        "errors": {"type": ["object", "null"]},
        "request_counts": _COUNTS,
        "metadata": {"type": ["object", "null"]},
    },
}
_BATCH_REQUEST = {
    "type": "object",
    "required": ["input_file_id", "endpoint", "completion_window"],
    "properties": {
        "input_file_id": {"type": "string"},
        "endpoint": {"enum": ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]},
        "completion_window": {"const": "24h"},
        "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}, "maxProperties": 16},
    },
}
_UPLOAD = {
    "type": "object",
    "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary"}, "purpose": {"const": "batch"}},
}


def _list(item: str) -> dict:
    return {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref(item)}},
    }


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


SCHEMAS = {
    "File": _FILE,
    "FileList": _list("File"),
    "Batch": _BATCH,
    "BatchList": _list("Batch"),
    "BatchCreateRequest": _BATCH_REQUEST,
    "FileUpload": _UPLOAD,
}


def paths(responses) -> dict:
    """The paths, each operation's answers built by `responses(ok)` (openapi._responses)."""

    def ok(description: str, schema: str, media: str = JSON) -> dict:
        return responses({"description": description, "content": {media: {"schema": _ref(schema)}}})

    def param(name: str) -> dict:
        return {"name": name, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}

    return {
        "/v1/files": {
            "post": {
                "summary": 'Upload a JSONL file of batch requests (purpose "batch")',
                "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": _ref("FileUpload")}}},
                "responses": ok("The file.", "File"),
            },
            "get": {"summary": "This tenant's files", "responses": ok("The files.", "FileList")},
        },
        "/v1/files/{file_id}": {
            "get": {"summary": "One file", "parameters": [param("file_id")], "responses": ok("The file.", "File")},
            "delete": {
                "summary": "Delete a file",
                "parameters": [param("file_id")],
                "responses": responses({"description": "Deleted.", "content": {JSON: {"schema": {"type": "object"}}}}),
            },
        },
        "/v1/files/{file_id}/content": {
            "get": {
                "summary": "A file's content (JSONL)",
                "parameters": [param("file_id")],
                "responses": responses(
                    {
                        "description": "The file's bytes.",
                        "content": {"application/jsonl": {"schema": {"type": "string"}}},
                    }
                ),
            }
        },
        "/v1/batches": {
            "post": {
                "summary": "Create a batch over an uploaded file",
                "requestBody": {"required": True, "content": {JSON: {"schema": _ref("BatchCreateRequest")}}},
                "responses": ok("The batch, validating.", "Batch"),
            },
            "get": {
                "summary": "This tenant's batches, newest first",
                "parameters": [
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                    {"name": "after", "in": "query", "schema": {"type": "string"}},
                ],
                "responses": ok("The batches.", "BatchList"),
            },
        },
        "/v1/batches/{batch_id}": {
            "get": {"summary": "One batch", "parameters": [param("batch_id")], "responses": ok("The batch.", "Batch")}
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": {
                "summary": "Cancel a batch: lines not sent yet are not sent; what finished is kept",
                "parameters": [param("batch_id")],
                "responses": ok("The batch, cancelling or cancelled.", "Batch"),
            }
        },
    }
