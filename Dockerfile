# One image for every role of the local standalone cluster (docker-compose.yml): Spark master,
# workers, the Spark Connect server and the client that runs spark-submit. It holds the same stack
# as .venv (README, "Stacks"), so the driver and the executors import identical code.
#
#   docker build -t sparkdl:local .
FROM python:3.11-slim-bookworm

# Java 17 for Spark (bookworm's default JRE), procps for Spark's scripts (ps), tini as PID 1 so
# the JVMs get signals and zombies are reaped.
RUN apt-get update \
    && apt-get install -y --no-install-recommends default-jre-headless procps tini \
    && rm -rf /var/lib/apt/lists/*
ENV JAVA_HOME=/usr/lib/jvm/default-java \
    PYSPARK_PYTHON=/usr/local/bin/python \
    PYSPARK_DRIVER_PYTHON=/usr/local/bin/python \
    PYTHONUNBUFFERED=1

WORKDIR /opt/sparkdl
# torch first, from PyTorch's CPU index: PyPI's torch==2.13.0 for Linux is the multi-GB CUDA build.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# Dependencies before the source, so editing sparkdl does not re-download pyspark: the newest
# tested stack (scripts/stacks/latest.txt), with the Spark Connect client.
COPY pyproject.toml README.md ./
COPY scripts/stacks ./scripts/stacks
RUN mkdir -p sparkdl connectors && touch sparkdl/__init__.py connectors/__init__.py \
    && pip install --no-cache-dir ".[connect]" scikit-learn --constraint scripts/stacks/latest.txt \
    && pip uninstall -y sparkdl-torch
COPY sparkdl ./sparkdl
COPY connectors ./connectors
RUN pip install --no-cache-dir --no-deps . && python -c "import sparkdl, torch, pyspark; print('sparkdl', sparkdl.__version__, 'torch', torch.__version__, 'pyspark', pyspark.__version__)"
# The spark-submit entry point, the digits example and the quiet log config.
COPY jobs ./jobs
COPY examples ./examples

ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["sparkdl", "--help"]
