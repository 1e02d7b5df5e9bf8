"""The size presets, one YAML file each (`angelgpt presets list`). Installed, this folder is the package
`angelgpt.configs` (pyproject's package-dir maps it), so a wheel carries the presets and
`importlib.resources` finds them there and in an editable checkout alike. Copy a file to edit it:
`cp configs/1.3b.yaml my.yaml`, then `angelgpt train --config my.yaml`."""
