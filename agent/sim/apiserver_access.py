"""Who may do what on the API-server emulator: an access table in place of RBAC.

Everything is allowed unless denied (``server.access.deny("delete", "resourceslices",
"resource.k8s.io")``). A denied request is answered 403 ``Forbidden`` with the real server's
wording; ``SelfSubjectAccessReview`` (``authorization.k8s.io/v1``) answers from the same table, and
``SelfSubjectReview`` (``authentication.k8s.io/v1``) names the emulator's one user, by default
the agent's service account as deploy/daemonset names it (with the groups the service-account
authenticator gives it), or the identity the server was built with. A request may act as another
user with the impersonation headers (``Impersonate-User``, ``Impersonate-Group``,
``Impersonate-Extra-<key>``), as the real server allows a user granted ``impersonate``; the
identity is what admission policies see as ``request.userInfo``.

RBAC matches a rule on the API group, the resource (``<resource>/<subresource>`` for a
subresource) and the verb; ``*`` matches any. A review of a namespaced resource with no
namespace asks about every namespace, as a ClusterRole grants (a deny here is cluster-wide).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from email.message import Message
from typing import Any
from urllib.parse import unquote

from agent.sim import apiserver_errors as err
from agent.sim.apiserver_admission_match import UserInfo
from agent.sim.apiserver_errors import ApiError

SSAR_PATH = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
SSR_PATH = "/apis/authentication.k8s.io/v1/selfsubjectreviews"
REVIEW_PATHS = (SSAR_PATH, SSR_PATH)
DEFAULT_USER = "system:serviceaccount:tessera-system:tessera"
DEFAULT_IDENTITY = UserInfo(
    DEFAULT_USER,
    ("system:serviceaccounts", "system:serviceaccounts:tessera-system", "system:authenticated"),
)
"""The agent's service account as the real server authenticates its token (groups from
k8s.io/apiserver pkg/authentication/serviceaccount, MakeGroupNames)."""
VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")


@dataclass(frozen=True)
class Rule:
    """A denied (group, resource, verb); ``*`` matches any."""

    verb: str
    resource: str
    group: str = ""

    def matches(self, verb: str, group: str, resource: str) -> bool:
        return (
            self.verb in ("*", verb)
            and self.group in ("*", group)
            and self.resource in ("*", resource)
        )


def verb_of(method: str, named: bool, watch: bool, collection_delete: bool) -> str:
    """The RBAC verb of a request (pure)."""
    if method == "GET":
        return "watch" if watch else "get" if named else "list"
    if method == "DELETE":
        return "deletecollection" if collection_delete else "delete"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())


class AccessRules:
    """The emulator's access table (thread-safe)."""

    def __init__(self, identity: UserInfo = DEFAULT_IDENTITY) -> None:
        self.identity = identity
        self.user = identity.username
        self._denied: list[Rule] = []
        self._lock = threading.Lock()

    def deny(self, verb: str, resource: str, group: str = "") -> None:
        """Refuse ``verb`` on ``resource`` (``resource/subresource``) of API ``group``."""
        with self._lock:
            self._denied.append(Rule(verb, resource, group))

    def allow_all(self) -> None:
        """Forget every deny."""
        with self._lock:
            self._denied.clear()

    def allowed(self, verb: str, group: str, resource: str) -> bool:
        with self._lock:
            return not any(r.matches(verb, group, resource) for r in self._denied)

    def forbidden(
        self, verb: str, group: str, resource: str, namespace: str | None, name: str | None
    ) -> ApiError:
        """The real server's 403 for a request RBAC denies."""
        qualified = f"{resource}.{group}" if group else resource
        what = f'{qualified} "{name}"' if name else qualified
        scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        in_group = f'in API group "{group}"'
        details: dict[str, Any] = {"kind": resource.split("/")[0]}
        if name:
            details["name"] = name
        if group:
            details["group"] = group
        return ApiError(
            403,
            "Forbidden",
            f'{what} is forbidden: User "{self.user}" cannot {verb} resource "{resource}"'
            f" {in_group} {scope}",
            details=details,
        )

    def access_review(self, body: Any) -> dict[str, Any]:
        """The answer to a SelfSubjectAccessReview ``body`` (422 when it asks nothing)."""
        spec = body.get("spec") if isinstance(body, dict) else None
        attrs = spec.get("resourceAttributes") if isinstance(spec, dict) else None
        if not isinstance(attrs, dict):
            raise ApiError(
                422,
                "Invalid",
                'SelfSubjectAccessReview.authorization.k8s.io "" is invalid:'
                " spec.resourceAttributes: Invalid value: null: exactly one of"
                " nonResourceAttributes or resourceAttributes must be specified",
            )
        resource = str(attrs.get("resource", ""))
        if attrs.get("subresource"):
            resource += f"/{attrs['subresource']}"
        verb, group = str(attrs.get("verb", "")), str(attrs.get("group", ""))
        yes = self.allowed(verb, group, resource)
        status: dict[str, Any] = {"allowed": yes}
        if yes:
            status["reason"] = "allowed by the emulator's access table"
        return {
            "kind": "SelfSubjectAccessReview",
            "apiVersion": "authorization.k8s.io/v1",
            "metadata": {},
            "spec": spec,
            "status": status,
        }

    def self_review(self) -> dict[str, Any]:
        """The answer to a SelfSubjectReview: who the caller is."""
        return {
            "kind": "SelfSubjectReview",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {},
            "status": {"userInfo": self.identity.cel()},
        }

    def caller(self, headers: Message[str, str]) -> UserInfo:
        """Who a request acts as: the impersonated user its headers name, else the server's
        identity. As the real filter
        (k8s.io/apiserver pkg/endpoints/filters/impersonation.go): extra keys are lowercased and
        unescaped; without Impersonate-Group a service account gets its groups, and every user
        but system:anonymous gets system:authenticated. 403 where ``impersonate`` is denied."""
        username = headers.get("Impersonate-User")
        if not username:
            return self.identity
        groups = list(headers.get_all("Impersonate-Group") or [])
        extra: dict[str, tuple[str, ...]] = {}
        for name in dict.fromkeys(headers.keys()):
            prefix, key = name[:18], name[18:]
            if prefix.lower() == "impersonate-extra-" and key:
                extra[unquote(key.lower())] = tuple(headers.get_all(name) or [])
        if not self.allowed("impersonate", "", "users"):
            raise self.forbidden("impersonate", "", "users", None, username)
        if not groups:
            parts = username.split(":")
            if len(parts) == 4 and parts[:2] == ["system", "serviceaccount"]:
                groups = ["system:serviceaccounts", f"system:serviceaccounts:{parts[2]}"]
            if username != "system:anonymous":
                groups.append("system:authenticated")
        return UserInfo(username, tuple(groups), extra)


def review(access: AccessRules, method: str, path: str, body: Any) -> dict[str, Any]:
    """The answer of a review endpoint (one of :data:`REVIEW_PATHS`; POST only)."""
    if method != "POST":
        raise err.method_not_allowed(method, path.rsplit("/", 1)[-1])
    return access.access_review(body) if path == SSAR_PATH else access.self_review()
