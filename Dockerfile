# streamfence in a container: the proxy in a virtualenv on python slim, run as a non-root
# user, listening on 0.0.0.0:8787 (the container's network is the boundary here).
#
#   docker build -t streamfence .
#   docker run --rm -p 127.0.0.1:8787:8787 -e STREAMFENCE_UPSTREAM_URL=https://api.openai.com streamfence
#   docker run --rm -p 127.0.0.1:8787:8787 -v "$PWD/streamfence.toml:/etc/streamfence/config.toml:ro" \
#       streamfence --config /etc/streamfence/config.toml
#
# Settings come from the mounted file, STREAMFENCE_* environment variables (they beat the
# file) or flags. Keep the port at 8787 inside the container and map it outside: the health
# check reads STREAMFENCE_SERVER_PORT. tests/test_ops_docker.py runs these install steps.

FROM python:3.11-slim-bookworm AS build
ENV VIRTUAL_ENV=/opt/streamfence \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE requirements.txt ./
COPY proxy/ proxy/
# The dependencies exactly as uv.lock pins them (requirements.txt is its export, hashes
# checked), so the image runs what CI tested; then the package itself. Every dependency
# ships wheels, so no compiler is needed; if one ever did not, this step fails loudly here
# instead of dragging build tools into the final image.
RUN python -m venv "$VIRTUAL_ENV" \
    && "$VIRTUAL_ENV/bin/pip" install --no-cache-dir --require-hashes -r requirements.txt \
    && "$VIRTUAL_ENV/bin/pip" install --no-cache-dir --no-deps .

FROM python:3.11-slim-bookworm
ARG VERSION=0.1.0
# OCI image annotations (https://specs.opencontainers.org/image-spec/annotations/).
LABEL org.opencontainers.image.title="streamfence" \
      org.opencontainers.image.description="A local HTTP proxy that fences superseded LLM streaming attempts: one writer per turn." \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="MIT" \
      org.opencontainers.image.source="https://github.com/streamfence/streamfence" \
      org.opencontainers.image.url="https://github.com/streamfence/streamfence" \
      org.opencontainers.image.documentation="https://github.com/streamfence/streamfence#readme" \
      org.opencontainers.image.vendor="the streamfence authors"
ENV VIRTUAL_ENV=/opt/streamfence \
    PATH=/opt/streamfence/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    STREAMFENCE_SERVER_HOST=0.0.0.0 \
    STREAMFENCE_SERVER_PORT=8787
RUN useradd --system --no-log-init --uid 10001 --user-group --no-create-home \
        --shell /usr/sbin/nologin streamfence
COPY --from=build /opt/streamfence /opt/streamfence
COPY config.example.toml /etc/streamfence/config.example.toml
COPY LICENSE /usr/share/doc/streamfence/LICENSE
USER 10001:10001
EXPOSE 8787
# No proxy for the probe itself: HTTP(S)_PROXY set for the upstreams must not catch it.
HEALTHCHECK --interval=15s --timeout=3s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:%s/_streamfence/healthz' % os.environ.get('STREAMFENCE_SERVER_PORT', '8787'), timeout=2)"]
ENTRYPOINT ["streamfence"]
