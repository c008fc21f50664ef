"""ValidatingAdmissionPolicies, evaluated by the API-server emulator as the real server does.

Every CREATE, UPDATE and DELETE (a ``status`` subresource's too, matched only by a rule that
names ``<resource>/status``) passes through :meth:`Admission.review` after the schema checks and
before it is stored, as the real chain runs validating admission after validation. Each
``admissionregistration.k8s.io/v1`` ValidatingAdmissionPolicyBinding whose policy exists is
taken in turn (policies, then their bindings, by name):

1. the policy's ``matchConstraints`` and the binding's ``matchResources`` must match
   (:mod:`~agent.sim.apiserver_admission_match`);
2. params: none without ``paramKind`` or ``paramRef``; else the objects of ``paramKind`` (any
   kind the store serves, cluster-scoped or namespaced: ``paramRef.namespace``, else the
   request's) named by ``paramRef.name`` or selected by ``paramRef.selector``; the policy is
   evaluated once per param; none found: nothing is evaluated (``parameterNotFoundAction``
   Allow) or the request is denied (Deny);
3. ``matchConditions``: any false skips the invocation, else an error applies ``failurePolicy``;
4. ``validations`` with ``variables`` (lazy: computed when an expression names
   ``variables.<name>``, each once); a validation not true fails with its ``messageExpression``
   (a non-empty one-line string), else ``message``, else ``failed expression: <expression>``,
   and its ``reason`` (default Invalid, 422; Forbidden 403, Unauthorized 401,
   RequestEntityTooLarge 413); an error fails too under ``failurePolicy`` Fail (the default);
5. the binding's ``validationActions``: Deny refuses the request with the first failure,
   ``<resource> "<name>" is forbidden: ValidatingAdmissionPolicy '<p>' with binding '<b>'
   denied request: <message>``; Warn adds a ``Warning`` header ``299 - "Validation failed for
   ValidatingAdmissionPolicy '<p>' with binding '<b>': <message>"``; Audit is recorded in
   :attr:`Admission.audits`. A binding's configuration error (params not found with Deny, an
   unknown paramKind) denies under Fail, as ``failed to configure binding: <why>``.

CEL variables: ``object`` and ``oldObject`` (null where the operation has none), ``request``
(:meth:`Attributes.request`), ``params`` (null without params), ``namespaceObject`` (null for a
cluster-scoped request) and ``variables``. Not provided: ``authorizer`` (the emulator has no
RBAC to ask), the Kubernetes CEL extension libraries beyond the ``cel`` package's standard ones
(strings, quantity, ...: an expression that calls one fails as an error), type checking at
write time, the cost budget, and ``auditAnnotations``. Resources of admissionregistration.k8s.io
are exempt, as upstream (rules.IsExemptAdmissionConfigurationResource), so a policy cannot lock
its own removal out.

Sources: k8s.io/apiserver pkg/admission/plugin/policy/generic/policy_dispatcher.go
(CollectParams, the messages of a param not found), policy/validating/dispatcher.go (actions,
the denial's and the warning's wording, reasonToCode), validating/validator.go (message
fallbacks), and kubernetes.io "Validating Admission Policy". The evaluator is written here
because no Python library evaluates admission policies; the CEL itself is the ``cel`` package.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import cel

from agent.sim.apiserver_admission_match import Attributes, UserInfo, labels_match, matches
from agent.sim.apiserver_errors import ApiError
from agent.sim.apiserver_types import ResourceType

Obj = dict[str, Any]
ADMISSION_GROUP = "admissionregistration.k8s.io"
POLICY_API = f"{ADMISSION_GROUP}/v1"
Lookup = Callable[[str, str], tuple[ResourceType, Sequence[Obj]] | None]
"""(apiVersion, kind) -> (its resource type, every stored object of it), None when not served."""

_CODES = {"Forbidden": 403, "Unauthorized": 401, "RequestEntityTooLarge": 413, "Invalid": 422}
_VARIABLE = re.compile(r"\bvariables\s*\.\s*([A-Za-z_][A-Za-z0-9_]*)")
_MAX_MESSAGE = 5 * 1024  # celconfig.MaxEvaluatedMessageExpressionSizeBytes


@dataclass
class Caller:
    """The request being served: who sent it, and the warnings its answer carries."""

    user: UserInfo
    warnings: list[str] = field(default_factory=list)


CALLER: ContextVar[Caller | None] = ContextVar("tessera_apiserver_caller", default=None)
"""The request in progress on this thread, set by the HTTP handler around each request: what the
real server carries in a request's context (its user, warning.AddWarning). Each handler thread
sees only its own; a write not made over HTTP (a test's put_object) has none."""


@dataclass(frozen=True)
class Failure:
    """One failed validation (or an error under failurePolicy Fail) of one invocation."""

    message: str
    reason: str = "Invalid"


@dataclass(frozen=True)
class AuditRecord:
    """A failure of a binding with validationActions Audit."""

    policy: str
    binding: str
    message: str
    operation: str
    resource: str
    namespace: str
    name: str


@dataclass
class Outcome:
    """What the policies decided about one request."""

    denials: list[tuple[str, str, Failure]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    audits: list[AuditRecord] = field(default_factory=list)


class _EvalError(Exception):
    """An expression that could not be evaluated (its message is the real server's form)."""


class Programs:
    """Compiled CEL expressions, each compiled once (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._compiled: dict[str, Any] = {}

    def run(self, expression: str, activation: Obj) -> Any:
        with self._lock:
            program = self._compiled.get(expression)
        try:
            if program is None:
                program = cel.compile(expression)
                with self._lock:
                    self._compiled[expression] = program
            return program.execute(activation)
        except Exception as exc:  # the cel package raises many types; each is an error here
            raise _EvalError(f"expression '{expression}' resulted in error: {exc}") from None


class _Scope:
    """One invocation's CEL activation, with ``variables`` computed lazily."""

    def __init__(
        self, programs: Programs, base: Obj, variables: Sequence[Mapping[str, Any]]
    ) -> None:
        self._programs = programs
        self._base = base
        self._defs = {str(v["name"]): str(v["expression"]) for v in variables}
        self._values: dict[str, Any] = {}
        self._errors: dict[str, str] = {}
        self._busy: set[str] = set()

    def run(self, expression: str) -> Any:
        """Evaluate ``expression``. The variables it names are computed first; one that fails is
        left out of ``variables``, so the expression fails with that variable's error only if
        it reaches it (CEL's && and || skip what they need not evaluate)."""
        names = [n for n in dict.fromkeys(_VARIABLE.findall(expression)) if n in self._defs]
        variables: Obj = {}
        failed: _EvalError | None = None
        for name in names:
            try:
                self._variable(name)
                variables[name] = self._values[name]
            except _EvalError as exc:
                failed = failed or exc
        try:
            return self._programs.run(expression, self._base | {"variables": variables})
        except _EvalError:
            if failed is not None:
                raise failed from None
            raise

    def _variable(self, name: str) -> None:
        if name in self._errors:
            raise _EvalError(self._errors[name])
        if name in self._values:
            return
        if name in self._busy:
            raise _EvalError(f'composited variable "{name}" refers to itself')
        self._busy.add(name)
        try:
            self._values[name] = self.run(self._defs[name])
        except _EvalError as exc:
            self._errors[name] = f'composited variable "{name}" fails to evaluate: {exc}'
            raise _EvalError(self._errors[name]) from None
        finally:
            self._busy.discard(name)


def validate(
    policy: Obj,
    attrs: Attributes,
    params: Obj | None,
    namespace: Obj | None,
    programs: Programs,
) -> list[Failure] | None:
    """One invocation of ``policy`` (its matchConditions, variables and validations) with
    ``params``: the failures, or None when a matchCondition is false (the policy does not
    apply). Matching of the request against the policy and binding is the caller's."""
    spec = policy.get("spec") or {}
    fail = (spec.get("failurePolicy") or "Fail") == "Fail"
    scope = _Scope(
        programs,
        {
            "object": attrs.obj,
            "oldObject": attrs.old,
            "request": attrs.request(),
            "params": params,
            "namespaceObject": namespace,
        },
        spec.get("variables") or [],
    )
    errors: list[str] = []
    for condition in spec.get("matchConditions") or []:
        try:
            result = scope.run(str(condition["expression"]))
        except _EvalError as exc:
            errors.append(str(exc))
            continue
        if result is not True:
            return None  # any false condition: not matched, errors or not
    if errors:
        return [Failure("; ".join(errors))] if fail else []
    failures: list[Failure] = []
    for validation in spec.get("validations") or []:
        expression = str(validation["expression"])
        try:
            ok = scope.run(expression)
        except _EvalError as exc:
            if fail:
                failures.append(Failure(str(exc)))
            continue
        if ok is True:
            continue
        failures.append(Failure(_message(scope, validation), validation.get("reason") or "Invalid"))
    return failures


def _message(scope: _Scope, validation: Mapping[str, Any]) -> str:
    """validator.go: the messageExpression's result when it is a non-empty string of one line
    (at most 5 KiB), else the message, else the failed expression."""
    message = ""
    if validation.get("messageExpression"):
        try:
            found = scope.run(str(validation["messageExpression"]))
        except _EvalError:
            found = None
        if isinstance(found, str):
            message = found.strip()
            if len(message) > _MAX_MESSAGE or "\n" in message:
                message = ""
    if not message:
        message = str(validation.get("message") or "").strip()
    return message or f"failed expression: {str(validation['expression']).strip()}"


def _params(policy: Obj, binding: Obj, attrs: Attributes, lookup: Lookup) -> list[Obj | None]:
    """CollectParams: the params to evaluate the policy with ([None]: without params).
    Raises _EvalError for a binding that cannot be configured."""
    kind = (policy.get("spec") or {}).get("paramKind")
    ref = (binding.get("spec") or {}).get("paramRef")
    if not kind or not ref:
        return [None]
    api_version, kind_name = str(kind.get("apiVersion", "")), str(kind.get("kind", ""))
    served = lookup(api_version, kind_name)
    if served is None:
        raise _EvalError(f"paramKind kind `{api_version}, Kind={kind_name}` not known")
    rt, objects = served
    wanted_ns: str | None = None
    if rt.namespaced:
        wanted_ns = ref.get("namespace") or attrs.namespace
        if not wanted_ns:
            raise _EvalError(
                "cannot use namespaced paramRef in policy binding that matches cluster-scoped"
                " resources"
            )
    elif ref.get("namespace"):
        raise _EvalError("paramRef.namespace must not be provided for a cluster-scoped `paramKind`")
    candidates = [
        o for o in objects if wanted_ns is None or o["metadata"].get("namespace") == wanted_ns
    ]
    if ref.get("name"):
        found = [o for o in candidates if o["metadata"].get("name") == ref["name"]]
    else:
        selector = ref.get("selector") or {}
        found = [o for o in candidates if labels_match(selector, o["metadata"].get("labels") or {})]
    if not found and ref.get("parameterNotFoundAction") == "Deny":
        raise _EvalError("no params found for policy binding with `Deny` parameterNotFoundAction")
    return list(found)


def _namespace(attrs: Attributes, lookup: Lookup) -> Obj | None:
    if not attrs.rt.namespaced:
        return None
    served = lookup("v1", "Namespace")
    found = [o for o in (served[1] if served else []) if o["metadata"]["name"] == attrs.namespace]
    return found[0] if found else None


def dispatch(attrs: Attributes, lookup: Lookup, programs: Programs) -> Outcome:
    """Every binding's decision about one request (nothing is raised: see :func:`refusal`)."""
    outcome = Outcome()
    if attrs.rt.group == ADMISSION_GROUP:
        return outcome
    policies = lookup(POLICY_API, "ValidatingAdmissionPolicy")
    bindings = lookup(POLICY_API, "ValidatingAdmissionPolicyBinding")
    if policies is None or bindings is None:
        return outcome
    by_policy: dict[str, list[Obj]] = {}
    for b in sorted(bindings[1], key=lambda o: str(o["metadata"]["name"])):
        by_policy.setdefault(str((b.get("spec") or {}).get("policyName", "")), []).append(b)
    namespace = _namespace(attrs, lookup)
    for policy in sorted(policies[1], key=lambda o: str(o["metadata"]["name"])):
        p_name = str(policy["metadata"]["name"])
        spec = policy.get("spec") or {}
        if not matches(spec.get("matchConstraints"), attrs, namespace):
            continue
        fail = (spec.get("failurePolicy") or "Fail") == "Fail"
        for binding in by_policy.get(p_name, []):
            b_spec = binding.get("spec") or {}
            if b_spec.get("matchResources") and not matches(
                b_spec["matchResources"], attrs, namespace
            ):
                continue
            b_name = str(binding["metadata"]["name"])
            try:
                params = _params(policy, binding, attrs, lookup)
            except _EvalError as exc:
                if fail:
                    failure = Failure(f"failed to configure binding: {exc}")
                    outcome.denials.append((p_name, b_name, failure))
                continue
            actions = b_spec.get("validationActions") or []
            for param in params:
                failures = validate(policy, attrs, param, namespace, programs) or []
                _act(outcome, p_name, b_name, actions, failures, attrs)
    return outcome


def _act(
    outcome: Outcome,
    policy: str,
    binding: str,
    actions: Sequence[str],
    failures: Sequence[Failure],
    attrs: Attributes,
) -> None:
    for failure in failures:
        if "Deny" in actions:
            outcome.denials.append((policy, binding, failure))
        if "Warn" in actions:
            outcome.warnings.append(
                f"Validation failed for ValidatingAdmissionPolicy '{policy}' with binding"
                f" '{binding}': {failure.message}"
            )
        if "Audit" in actions:
            outcome.audits.append(
                AuditRecord(
                    policy,
                    binding,
                    failure.message,
                    attrs.operation,
                    attrs.rt.qualified,
                    attrs.namespace,
                    attrs.name,
                )
            )


def refusal(attrs: Attributes, policy: str, binding: str, failure: Failure) -> ApiError:
    """The real server's answer to a denied request (admission.NewForbidden, with the
    decision's reason and its code)."""
    message = (
        f"ValidatingAdmissionPolicy '{policy}' with binding '{binding}' denied request:"
        f" {failure.message}"
    )
    name = attrs.name or "Unknown"
    details: Obj = {"name": name, "kind": attrs.rt.plural}
    if attrs.rt.group:
        details["group"] = attrs.rt.group
    details["causes"] = [{"message": message}]
    return ApiError(
        _CODES.get(failure.reason, 422),
        failure.reason,
        f'{attrs.rt.qualified} "{name}" is forbidden: {message}',
        details=details,
    )


def warning_header(text: str) -> str:
    """A ``Warning`` header value (RFC 7234 code 299, as the real server writes them)."""
    return '299 - "' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


class Admission:
    """The emulator's validating admission: :meth:`review` each write before it is stored."""

    def __init__(self, default_user: UserInfo) -> None:
        self._default_user = default_user
        self._programs = Programs()
        self._lock = threading.Lock()
        self._audits: list[AuditRecord] = []

    @property
    def audits(self) -> list[AuditRecord]:
        """The failures of bindings with validationActions Audit, oldest first."""
        with self._lock:
            return list(self._audits)

    def review(
        self,
        operation: str,
        rt: ResourceType,
        obj: Obj | None,
        old: Obj | None,
        subresource: str | None,
        dry_run: bool,
        types: Mapping[str, ResourceType],
        objects: Mapping[str, Mapping[Any, Obj]],
    ) -> None:
        """Raise the refusal (an ApiError) of a denied write; add the warnings of Warn bindings
        to the caller's answer. ``types`` and ``objects`` are the store's (by plural), read
        under its lock."""

        def lookup(api_version: str, kind: str) -> tuple[ResourceType, list[Obj]] | None:
            for t in types.values():
                if t.api_version == api_version and t.kind == kind:
                    return t, list(objects[t.plural].values())
            return None

        caller = CALLER.get()
        meta = (obj if obj is not None else old or {}).get("metadata") or {}
        attrs = Attributes(
            operation,
            rt,
            str(meta.get("namespace") or "") if rt.namespaced else "",
            str(meta.get("name") or ""),
            obj,
            old,
            caller.user if caller is not None else self._default_user,
            subresource or "",
            dry_run,
        )
        outcome = dispatch(attrs, lookup, self._programs)
        with self._lock:
            self._audits.extend(outcome.audits)
        if caller is not None:
            caller.warnings.extend(outcome.warnings)
        if outcome.denials:
            raise refusal(attrs, *outcome.denials[0])
