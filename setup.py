"""pip install entry point; the metadata lives in pyproject.toml.

hooks/ sits at the top level (framework adapters apart from the library) and installs as
the subpackage crossover.hooks.
"""

from setuptools import setup

setup(
    packages=[
        "crossover",
        "crossover.scheduler",
        "crossover.launch",
        "crossover.pipeline",
        "crossover.hooks",
    ],
    package_dir={"crossover": "crossover", "crossover.hooks": "hooks"},
    # crossoverrun puts this directory on a job's PYTHONPATH (not a package).
    package_data={"crossover.launch": ["inject/sitecustomize.py"]},
)
