# Sourced by the device scripts: installs the wheels carried in .whl/ (megatron-core and what else the
# offline GPU machine lacks) into /tmp/site and puts it on PYTHONPATH. .whl/ may hold builds for several
# Python versions (the device's Python can differ from this checkout's); of each package, the build that
# fits this python3 best is installed.
if ls .whl/*.whl > /dev/null 2>&1; then
  mapfile -t _wheels < <(python3 - .whl/*.whl <<'PY'
import sys
from pip._vendor.packaging.tags import sys_tags
from pip._vendor.packaging.utils import parse_wheel_filename

rank = {tag: i for i, tag in enumerate(sys_tags())}  # the interpreter's tags, most specific first
best = {}  # per project, the wheel whose most specific tag ranks first
for path in sys.argv[1:]:
    name, _, _, tags = parse_wheel_filename(path.rsplit("/", 1)[-1])
    ranks = [rank[t] for t in tags if t in rank]
    if ranks and (name not in best or min(ranks) < best[name][0]):
        best[name] = (min(ranks), path)
print("\n".join(path for _, path in best.values()))
PY
)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${_wheels[@]}"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
