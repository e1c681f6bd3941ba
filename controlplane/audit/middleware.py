"""Records which client address the audit entries of each web request came from."""

from asgiref.sync import iscoroutinefunction
from django.utils.decorators import sync_and_async_middleware

from controlplane.audit.services import audit_source
from controlplane.common.client_address import client_address


@sync_and_async_middleware
def audit_source_middleware(get_response):
    if iscoroutinefunction(get_response):

        async def middleware(request):
            with audit_source(client_address(request)):
                return await get_response(request)
    else:

        def middleware(request):
            with audit_source(client_address(request)):
                return get_response(request)

    return middleware
