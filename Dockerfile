# One image for every gpuserve process: the web server, the Celery worker and beat, and the GPU
# worker daemon (requirements/image.txt locks PyPI's torch, which carries CUDA, so the same image
# drives the GPU).
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DEBUG=0 \
    VAR_DIR=/app/var

WORKDIR /app
RUN useradd --create-home --uid 1000 gpuserve

# Only the hashed pins of the lock (written by `make lock`), in a layer of their own that a code
# change does not rebuild; then the project itself, built by the locked setuptools, with nothing else.
COPY requirements/image.txt requirements/image.txt
RUN pip install --require-hashes -r requirements/image.txt
COPY . .
RUN pip install --no-deps --no-build-isolation . \
    && mkdir -p /app/var \
    && chown -R gpuserve:gpuserve /app/var

USER gpuserve
EXPOSE 8000
# No proxy headers: TRUSTED_PROXIES (controlplane/common/client_address.py) decides whom to believe.
CMD ["uvicorn", "controlplane.asgi:application", "--host", "0.0.0.0", "--port", "8000", \
     "--no-proxy-headers"]
