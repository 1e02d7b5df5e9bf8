# Sourced by the device scripts: installs the wheels carried in .whl/ (megatron-core and what else the
# offline GPU machine lacks) into /tmp/site and puts it on PYTHONPATH.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
