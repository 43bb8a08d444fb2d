"""The frontend's side of SIGHUP: the reloaded tenants decide who may call, and with what limits, from now on.

The authenticator and admission switch in one step of the event loop (nothing awaits in between), so no request
is authenticated by the new list and limited by the old. A call already past authentication keeps the tenant it
was admitted as: a removed tenant's open streams run to their end, and its next call is refused UNAUTHENTICATED.
"""

from __future__ import annotations

import asyncio

from frontend.admission import AdmissionController
from frontend.spec import TenantSpec
from frontend.tenants import Authenticator


def apply_tenants(tenants: list[TenantSpec], authenticator: Authenticator, admission: AdmissionController, log) -> None:
    """Replaces the tenants of both; call it on the event loop's thread (it raises RuntimeError elsewhere), where
    requests are authenticated and admitted, so that none of them sees half of the change."""
    asyncio.get_running_loop()  # RuntimeError off the loop's thread, where a request could see half the change
    authenticator.replace(tenants)
    admission.replace_tenants(tenants)
    log.info("tenants_applied", tenants=[tenant.name for tenant in tenants])
