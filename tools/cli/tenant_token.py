"""Issue tenant tokens, and add, drop and list the keys that sign them.

  python -m tools tenant-token TENANT --ttl 1h   print a token for TENANT, signed with the newest key
  python -m tools tenant-token --new-key ID      add a fresh random 32-byte key (the file is kept mode 0600)
  python -m tools tenant-token --drop-key ID     retire a key: tokens it signed are refused from then on
  python -m tools tenant-token --list-keys       key ids, oldest first (never the secrets)

A token is a JWT signed with HS256: `kid` names the key, `sub` the tenant, `exp` its expiry.
A client sends it as the `tenant_token` request parameter or the `tenant-token` header; the
token names the tenant, so the `tenant` parameter is not needed. The keys file is the spec's
`[tenants.auth] keys_file` (build/tenant_keys.json) unless --keys says otherwise.

Rotating keys without a restart (the router and the llm re-read the keys file within a
second of a change; both keys verify while both are in the file):
  1. --new-key NEW     add the new key; it becomes the newest, so new tokens are signed with it
  2. issue tokens with it and hand them to the clients
  3. wait until every token signed by the old key has expired (its --ttl)
  4. --drop-key OLD    tokens still signed by the old key are refused from now on
Writing `{}` to the file revokes every token at once.

When an identity provider or gateway issues the tenants' tokens (RS256 or ES256, `sub` = the
tenant id), the keys file is its JWKS document (`{"keys": [...]}`) instead; the servers only
verify, and this command refuses to sign or change keys there.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import stat
import sys
import time
from pathlib import Path

from python_backends.common.quotas import TENANT_PATTERN
from python_backends.common.tenant_auth import ANONYMOUS_TENANT, KEY_ID_PATTERN, TOKEN_HEADER, TOKEN_PARAMETER
from tools.clients.tenant_token import KeysError, add_key, drop_key, issue, read_keys
from tools.paths import DEFAULT_SPEC
from tools.spec.serving import SpecError, load_spec

MAX_TTL_S = 400 * 86400  # a token is a bearer credential: long-lived ones are what leaks hurt most
DEFAULT_TTL_S = 3600.0
DURATION = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([smhd]?)$")
UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_s(text: str) -> float:
    """`90`, `90s`, `15m`, `1h`, `7d` in seconds, within [1, MAX_TTL_S]."""
    match = DURATION.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 30s, 15m, 1h or 7d")
    seconds = float(match.group(1)) * UNIT_S[match.group(2)]
    if not 1 <= seconds <= MAX_TTL_S:
        raise argparse.ArgumentTypeError(f"{text!r}: a token lives 1 s to {MAX_TTL_S // 86400} days")
    return seconds


def key_id(text: str) -> str:
    if not KEY_ID_PATTERN.fullmatch(text):
        raise argparse.ArgumentTypeError(f"key id {text!r} must be 1-32 letters, digits, '_' or '-'")
    return text


def tenant_id(text: str) -> str:
    if not TENANT_PATTERN.fullmatch(text):
        raise argparse.ArgumentTypeError(f"tenant id {text!r} must be 1-64 letters, digits, '.', '_' or '-'")
    if text == ANONYMOUS_TENANT:
        raise argparse.ArgumentTypeError(f"'{ANONYMOUS_TENANT}' is who a request without a token is; "
                                         "it needs no token")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("tenant", nargs="?", type=tenant_id, metavar="TENANT",
                        help="issue a token for this tenant and print it on stdout")
    action.add_argument("--new-key", type=key_id, metavar="ID",
                        help="add a fresh random key with this id (e.g. 2026-07); it signs new tokens from now on")
    action.add_argument("--drop-key", type=key_id, metavar="ID",
                        help="remove the key with this id; tokens it signed are refused within a second")
    action.add_argument("--list-keys", action="store_true", help="print the key ids, oldest first")
    parser.add_argument("--ttl", type=duration_s, default=None, metavar="DURATION",
                        help="how long the token is valid: 30s, 15m, 1h, 7d (at most 400d; default 1h)")
    parser.add_argument("--key-id", type=key_id, default=None, metavar="ID",
                        help="sign with this key instead of the newest one")
    parser.add_argument("--keys", type=Path, default=None, metavar="FILE",
                        help="the keys file (default: the spec's [tenants.auth] keys_file, build/tenant_keys.json)")
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC,
                        help="serving spec naming the keys file (default: %(default)s)")


def keys_file_of(args: argparse.Namespace) -> Path:
    if args.keys is not None:
        return args.keys
    spec = load_spec(args.spec)
    if spec.tenant_auth is None:
        raise KeysError(f"{spec.path}: [tenants.auth] mode is \"off\", so the servers take no tokens and the spec "
                        "names no keys file; pass --keys FILE to manage one anyway")
    return spec.tenant_auth.keys_file


def warn_if_readable_by_others(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            print(f"warning: {path} is readable by other users (mode {stat.filemode(mode)}); "
                  f"`chmod 600 {path}`", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if args.tenant is None and (args.ttl is not None or args.key_id is not None):
        print("error: --ttl and --key-id go with a TENANT to issue a token for", file=sys.stderr)
        return 2
    try:
        path = keys_file_of(args)
        warn_if_readable_by_others(path)
        if args.new_key:
            count = add_key(path, args.new_key)
            print(f"added key {args.new_key!r} to {path} ({count} key{'s' if count > 1 else ''}); it signs new "
                  "tokens from now on, and running servers accept them within a second", file=sys.stderr)
        elif args.drop_key:
            count = drop_key(path, args.drop_key)
            print(f"dropped key {args.drop_key!r} from {path}; {count} left. Tokens it signed are refused "
                  "within a second" + ("; with no key left, every token is" if not count else ""), file=sys.stderr)
        elif args.list_keys:
            keys = read_keys(path)
            for index, name in enumerate(keys):
                print(name + ("   (newest: signs new tokens)" if index == len(keys) - 1 else ""))
        else:
            ttl_s = args.ttl if args.ttl is not None else DEFAULT_TTL_S
            token, signed_with, expiry_s = issue(path, args.tenant, ttl_s, args.key_id)
            print(token)
            expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expiry_s))
            print(f"tenant {args.tenant!r}, key {signed_with!r}, valid until {expires}; send it as the "
                  f"'{TOKEN_PARAMETER}' parameter or the '{TOKEN_HEADER}' header", file=sys.stderr)
    except (KeysError, SpecError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
