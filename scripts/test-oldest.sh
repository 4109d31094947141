#!/usr/bin/env bash
# The test suite on the OLDEST releases pyproject.toml allows (its ">=" floors, installed as "=="),
# so that the floors stay true: a floor is the oldest release the suite has passed on.
# Not part of CI (it would double CI's time): run it before each release and whenever a floor or a
# use of a newer API changes; the README says so.
#   bash scripts/test-oldest.sh                       # the whole suite
#   bash scripts/test-oldest.sh tests/test_loading.py # a part of it
# VENV (default /tmp/shardtune-oldest) is made once and reused. torch comes from PyTorch's CPU index
# (TORCH_INDEX); TORCH_SITE=/path/to/site-packages uses an installed torch of the floor version instead
# (the venv then reads that site-packages after its own, so the pinned releases win).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/shardtune-oldest}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
# Every floor is pinned: the package's own and each feature extra's (torchao, datasets, trackers, gguf...);
# the test tools alone (pytest, ruff, hypothesis, ...) come at their newest.
mapfile -t PINS < <(python3 - <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
floors = project["dependencies"] + [d for name, deps in extras.items() if name != "test" for d in deps]
names = {d.split(">=")[0] for d in floors}
for dep in dict.fromkeys(floors + extras["test"]):
    print(re.sub(r">=", "==", dep) if dep.split(">=")[0] in names else dep)
PY
)
TORCH_PIN=$(printf '%s\n' "${PINS[@]}" | grep '^torch==')
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
if [ -n "${TORCH_SITE:-}" ]; then
  "$VENV/bin/python" -c "import site; open(site.getsitepackages()[0] + '/zz_torch_site.pth', 'w').write('$TORCH_SITE\n')"
  "$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('${TORCH_PIN#torch==}'), torch.__version__"
else
  "$VENV/bin/pip" install -q --index-url "$TORCH_INDEX" "$TORCH_PIN"
fi
"$VENV/bin/pip" install -q $(printf '%s\n' "${PINS[@]}" | grep -v '^torch==')
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -c "import torch, transformers, peft; print('oldest:', torch.__version__, transformers.__version__, peft.__version__)"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "${@:-tests}"
