#!/usr/bin/env bash
# Print the path of a Python >= 3.12 interpreter, or fail with a message.
# Order: python3.12 / python3.13 / python3 on PATH, then pyenv's installed 3.12+/3.13+.
set -u
ok() { "$@" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
for cand in python3.12 python3.13 python3; do
  if command -v "$cand" >/dev/null 2>&1 && ok "$cand"; then
    command -v "$cand" | head -n1; exit 0
  fi
done
if command -v pyenv >/dev/null 2>&1; then
  for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])(\.|$)' | sort -V); do
    p="$(pyenv root)/versions/$v/bin/python3"
    if [ -x "$p" ] && ok "$p"; then echo "$p"; exit 0; fi
  done
fi
echo "error: no Python >= 3.12 found (tried python3.13, python3.12, python3 and pyenv)" >&2
exit 1
