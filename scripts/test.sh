#!/usr/bin/env bash
# Install (if needed) and run the whole test suite: bash scripts/test.sh [pytest args]
# pytest's exit code 5 ("no tests collected") is a failure here, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh || exit 1
.venv/bin/python -m pytest -q -ra "${@:-tests}"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
