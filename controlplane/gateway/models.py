"""What the public API keeps between requests: responses of the Responses API (`store`, the
default), so that `previous_response_id` can continue a conversation and GET can read one back."""

from django.db import models

from controlplane.common.json_text import JSONTextField


class StoredResponse(models.Model):
    """One answer of POST /v1/responses, the tenant's until it deletes it or the retention
    (GATEWAY_RESPONSES_RETENTION_DAYS) sweeps it away."""

    id = models.CharField(primary_key=True, max_length=64)
    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.CASCADE, related_name="+")
    created_at = models.DateTimeField(db_index=True)
    # A background response is answered "queued" at once and runs on in a gateway process; its
    # row follows it to completed, incomplete, failed or cancelled.
    background = models.BooleanField(default=False)
    status = models.CharField(max_length=16, default="completed")
    # What a background response needs to be run again by another gateway process if the one
    # running it dies: the request as it came, the key it came with and the request id its
    # credit is held and charged under (the same for every run: it is charged once).
    request = models.TextField(blank=True, default="")
    api_key = models.ForeignKey("accounts.ApiKey", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    request_id = models.CharField(max_length=64, blank=True, default="")
    # The gateway process running it and until when that claim holds unless renewed; a running
    # response whose claim ran out is taken over by another process (stored_responses_claim).
    lease_owner = models.CharField(max_length=64, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True, db_index=True)
    runs = models.PositiveSmallIntegerField(default=0, help_text="How many times a gateway process took it up.")
    # JSON as text, not jsonb: model output may hold NUL characters, which jsonb cannot.
    # This request's input, as items (GET .../input_items lists them).
    input_items = JSONTextField()
    # The conversation up to and including this response's output, as items: a request naming
    # this one as its previous_response_id continues from here (instructions are not carried).
    history = JSONTextField()
    # The response object as it was answered.
    response = JSONTextField()

    class Meta:
        indexes = [models.Index(fields=["tenant", "created_at"])]

    def __str__(self) -> str:
        return self.id
