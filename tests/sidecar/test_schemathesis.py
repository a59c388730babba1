"""Property-based API conformance: schemathesis generates requests from our own OpenAPI schema.

Checked: responses match their documented schemas, status codes and content types; schema-invalid
requests are rejected; no server error except the documented 503 when the pool is exhausted.
Not checked: that every schema-valid request is accepted (``positive_data_acceptance``): rules
that depend on the pool's state (a commit beyond the sequence, a pin of nothing cached) or span
fields (``num_tokens`` against the block count) rightly reject some of them with 404/409/422.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from kvpool_sidecar.config import SidecarConfig
from kvpool_sidecar.service.app import create_app
from kvpool_sidecar.service.credentials import Credentials
from kvpool_sidecar.service.state import Sidecar
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import positive_data_acceptance

CONFIG = SidecarConfig.model_validate(
    {"pageSize": 4, "eviction": {"policy": "workload_adaptive"}, "pinning": {"autoPin": {"enabled": False}}}
)
SIDECAR = Sidecar(CONFIG, 512)
APP = create_app(SIDECAR)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
# With authentication on, as a tenant credential (the most restricted role that can do anything).
AUTHED = Sidecar(CONFIG, 512)
AUTHED_APP = create_app(AUTHED, token=Credentials.parse("admin admin-token-0123456789\n"
                                                        "tenant:acme acme-token-0123456789"))
authed_schema = schemathesis.openapi.from_asgi("/openapi.json", AUTHED_APP)


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_schema(case):
    response = case.call()
    case.validate_response(response, excluded_checks=[not_a_server_error, positive_data_acceptance])
    if response.status_code >= 500:
        assert response.status_code == 503 and response.json()["error"] == "pool_exhausted", response.text
    SIDECAR.pool.check_invariants()


@authed_schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_with_authentication_on(case):
    response = case.call(headers={"authorization": "Bearer acme-token-0123456789"})
    case.validate_response(response, excluded_checks=[not_a_server_error, positive_data_acceptance])
    if response.status_code >= 500:
        assert response.status_code == 503 and response.json()["error"] == "pool_exhausted", response.text
    AUTHED.pool.check_invariants()
    assert AUTHED.state.config.tenancy.isolation == "perTenant"  # a tenant never changes the config
