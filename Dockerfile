# bucket-rls container image.
#
#   docker build -t bucket-rls .
#   docker run --rm -p 8081:8081 -p 8080:8080 bucket-rls            # memory backend, example config
#   docker run --rm -e BUCKET_RLS_REDIS_URL=redis://redis:6379 \
#     -v "$PWD/config:/etc/bucket-rls:ro" bucket-rls                 # your config directory, Redis
#
# Every flag is also an environment variable BUCKET_RLS_<FLAG>.
#
# Drop-in for the Go reference service: /bin/ratelimit is a link to the
# binary; run with no arguments under that name (Envoy Gateway, the Istio
# sample and the Go docker-compose files use `command: ["/bin/ratelimit"]`),
# it reads the Go service's environment variables (README, "Replacing the Go
# service"):
#   docker run --rm --entrypoint /bin/ratelimit -e REDIS_URL=redis:6379 \
#     -e RUNTIME_ROOT=/data -e RUNTIME_SUBDIRECTORY=ratelimit \
#     -v "$PWD/config:/data/ratelimit/config:ro" bucket-rls

# ---- build ----------------------------------------------------------------
FROM rust:1-bookworm AS builder
WORKDIR /src

# Dependency layer: compile every dependency against placeholder sources, so
# that a change under src/ reuses this layer and rebuilds only the crate.
# Placeholders are made for the library, the binary and any [[bench]] target
# named in Cargo.toml (cargo refuses a manifest whose targets are missing).
COPY Cargo.toml Cargo.lock ./
RUN mkdir -p src benches \
 && echo 'fn main() {}' > src/main.rs \
 && touch src/lib.rs \
 && for b in $(awk '/^\[\[bench\]\]/{b=1;next} /^\[/{b=0} b && /^name *=/{gsub(/[" ]/,""); sub(/^name=/,""); print}' Cargo.toml); do \
      echo 'fn main() {}' > "benches/$b.rs"; \
    done \
 && cargo build --release --locked --bin bucket-rls \
 && rm -rf src benches

# The crate itself. COPY keeps the files' old timestamps: touch them so cargo
# does not take the placeholder build for up to date. The image gets the
# binary without its line tables (kept in release builds for profiling), so
# the image is much smaller; symbols stay, so panics still name functions.
COPY . .
RUN touch src/main.rs src/lib.rs \
 && cargo build --release --locked --bin bucket-rls \
 && install -D -m 0755 target/release/bucket-rls /out/bucket-rls \
 && strip --strip-debug /out/bucket-rls

# ---- runtime --------------------------------------------------------------
# Same Debian release as the builder (glibc). No extra packages: TLS to Redis
# (rediss://) uses the WebPKI roots compiled into the binary.
FROM debian:bookworm-slim
COPY --from=builder /out/bucket-rls /usr/local/bin/bucket-rls
# Started under this name with no arguments, the binary takes its settings
# from the Go service's environment variables. The link is made at build
# time; the binary writes no file at run time (read-only root file system).
RUN ln -s /usr/local/bin/bucket-rls /bin/ratelimit
# The default config directory; mount your own over it (a Kubernetes
# ConfigMap as a directory, not subPath, so hot reload sees updates).
COPY config/example.yaml /etc/bucket-rls/example.yaml
# Numeric non-root user, so Kubernetes runAsNonRoot can verify it.
USER 10001:10001
# gRPC (RateLimitService, grpc.health.v1) and HTTP admin (/healthcheck, /metrics, /rlconfig, /json);
# as /bin/ratelimit also the debug port (plain-text /rlconfig) and, with
# USE_PROMETHEUS=true, PROMETHEUS_ADDR (Envoy Gateway: 19001).
EXPOSE 8081 8080 6070
ENTRYPOINT ["/usr/local/bin/bucket-rls"]
CMD ["serve", "--config", "/etc/bucket-rls"]
