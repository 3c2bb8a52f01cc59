# bucket-rls container image.
#
#   docker build -t bucket-rls .
#   docker run --rm -p 8081:8081 -p 8080:8080 bucket-rls            # memory backend, example config
#   docker run --rm -e BUCKET_RLS_REDIS_URL=redis://redis:6379 \
#     -v "$PWD/config:/etc/bucket-rls:ro" bucket-rls                 # your config directory, Redis
#
# Every flag is also an environment variable BUCKET_RLS_<FLAG>.

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
# The default config directory; mount your own over it (a Kubernetes
# ConfigMap as a directory, not subPath, so hot reload sees updates).
COPY config/example.yaml /etc/bucket-rls/example.yaml
# Numeric non-root user, so Kubernetes runAsNonRoot can verify it.
USER 10001:10001
# gRPC (RateLimitService, grpc.health.v1) and HTTP admin (/healthcheck, /metrics, /rlconfig, /json).
EXPOSE 8081 8080
ENTRYPOINT ["/usr/local/bin/bucket-rls"]
CMD ["serve", "--config", "/etc/bucket-rls"]
