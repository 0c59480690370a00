"""Secrets as shown and stored: environment values whose names say they are secret, and a URL's user:password,
masked in dry runs, job files, logs and errors (the nodes still get the real values)."""

from __future__ import annotations

import re

SECRET_NAME_RE = re.compile(r"TOKEN|KEY|PASSWORD|PASSWD|SECRET|CREDENTIAL", re.IGNORECASE)
MASK = "****"


def is_secret(name: str) -> bool:
    return bool(SECRET_NAME_RE.search(name))


def masked_env(env: dict[str, str]) -> dict[str, str]:
    return {k: (MASK if is_secret(k) else v) for k, v in env.items()}


def secret_values(env: dict[str, str]) -> list[str]:
    return [v for k, v in env.items() if is_secret(k) and v]


def url_masked(url: str) -> str:
    """A URL as shown and stored: a user:password@ in it becomes ****@ (the node still gets the real one)."""
    return re.sub(r"//[^/@]*@", "//****@", url)


def mask_text(text: str, secrets: list[str]) -> str:
    """Every secret value hidden; a multi-line secret also line by line (logs are shown a line at a time)."""
    for value in secrets:
        text = text.replace(value, MASK)
        for part in value.splitlines():
            if len(part) >= 4:  # a very short piece would mask ordinary text
                text = text.replace(part, MASK)
    return text
