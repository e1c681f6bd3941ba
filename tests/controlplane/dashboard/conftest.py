"""Fixtures the dashboard's tests request by name: the operator and their logged-in client, and (for the
playground) the gateway tests' gateway and CPU replicas. Imported here rather than into each test module,
where a test's parameter of the same name would read as a redefinition of the import (ruff's F811)."""

from tests.controlplane.dashboard.ops_support import operator, operator_client  # noqa: F401 (fixtures)
from tests.controlplane.gateway.conftest import (  # noqa: F401 (fixtures)
    checkpoint,
    database_url,
    gateway,
    replica_processes,
    replicas,
)
