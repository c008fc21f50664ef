"""Versions as k8s' ``library.SemverLib`` reads them: blang/semver v4 parsing and ordering,
and the normalisation ``semver(text, true)`` applies."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Semver:
    major: int
    minor: int
    patch: int
    pre: tuple[int | str, ...]

    def text(self) -> str:
        core = f"{self.major}.{self.minor}.{self.patch}"
        return core + ("-" + ".".join(str(p) for p in self.pre) if self.pre else "")

    def compare(self, other: Semver) -> int:
        """blang/semver ``Version.Compare``: numbers, then a release above its pre-releases,
        then pre-release identifiers pairwise (numeric below alphanumeric), shorter first."""
        a, b = (self.major, self.minor, self.patch), (other.major, other.minor, other.patch)
        if a != b:
            return 1 if a > b else -1
        if not self.pre or not other.pre:
            return (not self.pre) - (not other.pre)
        for x, y in zip(self.pre, other.pre, strict=False):
            if x == y:
                continue
            if isinstance(x, int) and isinstance(y, int):
                return 1 if x > y else -1
            if isinstance(x, int) or isinstance(y, int):
                return -1 if isinstance(x, int) else 1
            return 1 if str(x) > str(y) else -1
        return (len(self.pre) > len(other.pre)) - (len(self.pre) < len(other.pre))


_DIGITS = frozenset("0123456789")
_ALNUM = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-")


def parse_semver(text: str) -> Semver:
    """blang/semver v4 ``Parse`` (strict semver 2.0.0); ValueError in its words otherwise."""
    if not text:
        raise ValueError("Version string empty")
    parts = text.split(".", 2)
    if len(parts) != 3:
        raise ValueError("No Major.Minor.Patch elements found")
    numbers: list[int] = []
    patch = parts[2]
    build: list[str] = []
    pre: list[str] = []
    if "+" in patch:
        patch, _, meta = patch.partition("+")
        build = meta.split(".")
    if "-" in patch:
        patch, _, release = patch.partition("-")
        pre = release.split(".")
    for what, digits in (("major", parts[0]), ("minor", parts[1]), ("patch", patch)):
        if not set(digits) <= _DIGITS:
            raise ValueError(f"Invalid character(s) found in {what} number {digits!r}")
        if len(digits) > 1 and digits[0] == "0":
            raise ValueError(
                f"{what.capitalize()} number must not contain leading zeroes {digits!r}"
            )
        if not digits or int(digits) >= 2**64:
            raise ValueError(f"invalid {what} number {digits!r}")
        numbers.append(int(digits))
    identifiers: list[int | str] = []
    for ident in pre:
        if not ident:
            raise ValueError("Prerelease is empty")
        if set(ident) <= _DIGITS:
            if len(ident) > 1 and ident[0] == "0":
                raise ValueError(
                    f"Numeric PreRelease version must not contain leading zeroes {ident!r}"
                )
            identifiers.append(int(ident))
        elif set(ident) <= _ALNUM:
            identifiers.append(ident)
        else:
            raise ValueError(f"Invalid character(s) found in prerelease {ident!r}")
    for meta in build:
        if not meta:
            raise ValueError("Build meta data is empty")
        if not set(meta) <= _ALNUM:
            raise ValueError(f"Invalid character(s) found in build meta data {meta!r}")
    return Semver(numbers[0], numbers[1], numbers[2], tuple(identifiers))


def normalize_semver(text: str) -> str:
    """k8s library/semverlib.go ``normalizeAndParse``: drop a leading "v", strip leading
    zeros, fill a missing minor and patch with 0."""
    parts = text.removeprefix("v").split(".", 2)
    for i, part in enumerate(parts):
        if len(part) > 1:
            part = part.lstrip("0")
            if not part or part[0] not in _DIGITS:
                part = "0" + part
            parts[i] = part
    if len(parts) < 3:
        if "+" in parts[-1] or "-" in parts[-1]:
            raise ValueError("short version cannot contain PreRelease/Build meta data")
        parts += ["0"] * (3 - len(parts))
    return ".".join(parts)
