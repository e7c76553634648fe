//! Harness for the acceptance tests: the real Terraform CLI against the freshly
//! built provider, through `dev_overrides` in a CLI configuration of our own.
//!
//! Each [`Workspace`] is a temporary directory with its own store, and its nodes
//! and distributors live on a loopback prefix of their own, so that tests run in
//! parallel without meeting. When a workspace is dropped it destroys what it
//! applied and kills any process that is still left (a failed test must not leave
//! nodes behind for the next one).

use serde_json::Value;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `target/debug`, where cargo put the provider and `lbscale-node`.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/debug/deps/<test> -> target/debug
    exe.parent()
        .and_then(Path::parent)
        .expect("target dir")
        .to_path_buf()
}

/// The pinned Terraform: `LBSCALE_TERRAFORM`, else `.tools/bin/terraform`.
pub fn terraform() -> PathBuf {
    if let Ok(p) = std::env::var("LBSCALE_TERRAFORM") {
        return p.into();
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let p = root.join(".tools/bin/terraform");
    assert!(
        p.is_file(),
        "Terraform is not installed: run scripts/install-terraform.sh (looked for {})",
        p.display()
    );
    p
}

/// One Terraform CLI the lifecycle tests run under.
#[derive(Debug, Clone)]
pub struct TerraformCli {
    pub path: PathBuf,
    /// As `terraform version -json` reports it, e.g. (1, 11, 4).
    pub version: (u32, u32, u32),
}

impl TerraformCli {
    /// Asks `path` for its version; the error says what is wrong and what to do.
    pub fn probe(path: &Path) -> Result<TerraformCli, String> {
        let fix = "fix LBSCALE_TERRAFORMS (colon-separated paths of Terraform binaries) \
                   or unset it to test the pinned Terraform only";
        let out = Command::new(path)
            .args(["version", "-json"])
            .env("CHECKPOINT_DISABLE", "1")
            .output()
            .map_err(|e| {
                format!(
                    "LBSCALE_TERRAFORMS: cannot run {}: {e}; {fix}",
                    path.display()
                )
            })?;
        let version = serde_json::from_slice::<Value>(&out.stdout)
            .ok()
            .and_then(|v| v["terraform_version"].as_str().map(str::to_string))
            .and_then(|v| {
                let mut parts = v.split(['.', '-']).map(|p| p.parse::<u32>().ok());
                Some((parts.next()??, parts.next()??, parts.next()??))
            })
            .filter(|_| out.status.success())
            .ok_or_else(|| {
                format!(
                    "LBSCALE_TERRAFORMS: {} is not a Terraform CLI (`version -json` gave no \
                     terraform_version); {fix}",
                    path.display()
                )
            })?;
        Ok(TerraformCli {
            path: path.to_path_buf(),
            version,
        })
    }

    /// "1.11.4".
    pub fn label(&self) -> String {
        let (a, b, c) = self.version;
        format!("{a}.{b}.{c}")
    }

    /// At least `major.minor`.
    pub fn at_least(&self, major: u32, minor: u32) -> bool {
        (self.version.0, self.version.1) >= (major, minor)
    }
}

/// The Terraforms of `LBSCALE_TERRAFORMS` (colon-separated paths, as
/// scripts/test.sh sets it: the pinned one and the one on PATH), else the
/// pinned one alone.
pub fn terraforms_from(list: Option<&str>) -> Result<Vec<TerraformCli>, String> {
    match list.filter(|l| !l.trim().is_empty()) {
        None => TerraformCli::probe(&terraform()).map(|t| vec![t]),
        Some(list) => list
            .split(':')
            .filter(|p| !p.is_empty())
            .map(|p| TerraformCli::probe(Path::new(p)))
            .collect(),
    }
}

/// [`terraforms_from`] the environment; panics with its error.
pub fn terraforms() -> Vec<TerraformCli> {
    terraforms_from(std::env::var("LBSCALE_TERRAFORMS").ok().as_deref())
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The environment variables that the gcp cloud's settings fall back to.
pub const GCP_ENV: [&str; 8] = [
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GCE_METADATA_HOST",
    "CLOUDSDK_CONFIG",
    "GOOGLE_CLOUD_PROJECT",
    "CLOUDSDK_CORE_PROJECT",
    "CLOUDSDK_COMPUTE_REGION",
    "LBSCALE_GCP_ENDPOINT",
    "LBSCALE_GCP_CA_BUNDLE",
];

/// The environment variables that the azure cloud's settings fall back to.
pub const AZURE_ENV: [&str; 19] = [
    "ARM_SUBSCRIPTION_ID",
    "AZURE_SUBSCRIPTION_ID",
    "ARM_CLIENT_ID",
    "ARM_CLIENT_SECRET",
    "ARM_TENANT_ID",
    "ARM_OIDC_TOKEN_FILE_PATH",
    "ARM_USE_MSI",
    "AZURE_CLIENT_ID",
    "AZURE_CLIENT_SECRET",
    "AZURE_TENANT_ID",
    "AZURE_FEDERATED_TOKEN_FILE",
    "AZURE_AUTHORITY_HOST",
    "AZURE_POD_IDENTITY_AUTHORITY_HOST",
    "LBSCALE_AZURE_RESOURCE_GROUP",
    "LBSCALE_AZURE_LOCATION",
    "LBSCALE_AZURE_ENDPOINT",
    "LBSCALE_AZURE_CA_BUNDLE",
    "LBSCALE_AZURE_IMAGE",
    "LBSCALE_AZURE_VM_SIZE",
];

/// The environment variables that the aws cloud's settings fall back to.
pub const AWS_ENV: [&str; 22] = [
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
    "AWS_ROLE_SESSION_NAME",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN",
    "LBSCALE_AWS_ROLE_ARN",
    "LBSCALE_AWS_EXTERNAL_ID",
    "LBSCALE_AWS_ROLE_SESSION_NAME",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_CA_BUNDLE",
    "LBSCALE_AWS_IMAGE_ID",
    "LBSCALE_AWS_INSTANCE_TYPE",
];

/// The longest a Terraform command of a test may run (an apply waits for nodes,
/// a destroy for drains: both bounded far below this by the tests' settings).
pub const TERRAFORM_LIMIT: Duration = Duration::from_secs(15 * 60);

/// Runs `cmd` to its end like [`Command::output`], killing it after `limit`
/// with a panic that names `what`: a hung command must not hang the suite.
pub fn output_within(cmd: &mut Command, limit: Duration, what: &str) -> std::process::Output {
    let mut child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("could not start {what}: {e}"));
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            buf
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for a child") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "timed out after {}s waiting for {what} to end",
                limit.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    std::process::Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}

pub struct Output {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn all(&self) -> String {
        format!("{}\n{}", self.stdout, self.stderr)
    }
}

pub struct Workspace {
    pub dir: PathBuf,
    pub prefix: String,
    /// The provider's `state` URL; `None` for the default SQLite file.
    pub state: Option<String>,
    /// Give `state` to the provider through the environment (`LBSCALE_STATE`)
    /// instead of its `state` argument.
    pub state_from_env: bool,
    /// More blocks of the provider (an `aws` block, say), as HCL.
    pub provider_blocks: String,
    /// The Terraform CLI this workspace runs (default: the pinned one).
    pub terraform: PathBuf,
    cli_config: PathBuf,
    applied: bool,
}

impl Workspace {
    /// A new workspace whose nodes take addresses under `127.<octet>.`.
    pub fn new(name: &str, octet: u8) -> Workspace {
        let dir = std::env::temp_dir().join(format!("lbscale-acc-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let provider_dir = bin_dir();
        assert!(
            provider_dir.join("terraform-provider-lbscale").is_file()
                && provider_dir.join("lbscale-node").is_file(),
            "build the provider and the node first (cargo build --workspace): {}",
            provider_dir.display()
        );
        let cli_config = dir.join("cli.tfrc");
        std::fs::write(
            &cli_config,
            format!(
                "provider_installation {{\n  dev_overrides {{\n    \"lbscale/lbscale\" = \"{}\"\n  }}\n  direct {{}}\n}}\n",
                provider_dir.display()
            ),
        )
        .unwrap();
        Workspace {
            dir,
            prefix: format!("127.{octet}."),
            state: None,
            state_from_env: false,
            provider_blocks: String::new(),
            terraform: terraform(),
            cli_config,
            applied: false,
        }
    }

    /// Installs the provider with `terraform init` from the filesystem mirror
    /// `mirror` (as users do) instead of `dev_overrides`.
    pub fn use_mirror(&self, mirror: &Path) {
        std::fs::write(
            &self.cli_config,
            format!(
                "provider_installation {{\n  filesystem_mirror {{\n    path    = {:?}\n    include = [\"lbscale/lbscale\"]\n  }}\n  direct {{\n    exclude = [\"lbscale/lbscale\"]\n  }}\n}}\n",
                mirror.display().to_string()
            ),
        )
        .unwrap();
    }

    /// The provider block and `required_providers` every configuration starts with.
    pub fn header(&self) -> String {
        format!(
            r#"terraform {{
  required_providers {{
    lbscale = {{ source = "lbscale/lbscale" }}
  }}
}}

provider "lbscale" {{{}
  local {{
    address_prefix = "{}"
  }}
{}}}
"#,
            self.state
                .as_ref()
                .filter(|_| !self.state_from_env)
                .map(|s| format!("\n  state = {s:?}"))
                .unwrap_or_default(),
            self.prefix,
            self.provider_blocks
        )
    }

    /// Copies `examples/modules/fleet` to `modules/fleet` in the workspace,
    /// for a `main.tf` that calls it (install it with `terraform get` once
    /// that is written).
    pub fn copy_fleet_module(&self) {
        let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/modules/fleet");
        let to = self.dir.join("modules/fleet");
        std::fs::create_dir_all(&to).unwrap();
        for e in std::fs::read_dir(&from).unwrap().flatten() {
            if e.path().extension().is_some_and(|x| x == "tf") {
                std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
            }
        }
    }

    /// Writes `main.tf`: the header followed by `body`.
    pub fn write(&self, body: &str) {
        std::fs::write(
            self.dir.join("main.tf"),
            format!("{}\n{}", self.header(), body),
        )
        .unwrap();
    }

    pub fn tf(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(&self.terraform);
        // The store and the clouds' settings are what the test says, never
        // what the caller's shell has.
        cmd.env_remove(lbscale_engine::store::STATE_URL_ENV);
        for var in AWS_ENV.iter().chain(&GCP_ENV).chain(&AZURE_ENV) {
            cmd.env_remove(var);
        }
        if let (Some(url), true) = (&self.state, self.state_from_env) {
            cmd.env(lbscale_engine::store::STATE_URL_ENV, url);
        }
        cmd.args(args)
            .current_dir(&self.dir)
            .env("TF_CLI_CONFIG_FILE", &self.cli_config)
            .env("CHECKPOINT_DISABLE", "1")
            .env("TF_IN_AUTOMATION", "1")
            // A belt only: the provider itself must never report a backtrace.
            .env_remove("RUST_BACKTRACE")
            .env_remove("TF_LOG");
        let out = output_within(
            &mut cmd,
            TERRAFORM_LIMIT,
            &format!("terraform {}", args.join(" ")),
        );
        Output {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// `terraform apply`; panics with Terraform's output when it fails.
    pub fn apply(&mut self) -> Output {
        self.applied = true;
        let o = self.tf(&["apply", "-auto-approve", "-no-color", "-input=false"]);
        assert_eq!(o.code, 0, "terraform apply failed:\n{}", o.all());
        o
    }

    /// `terraform plan -detailed-exitcode`: 0 no changes, 2 changes, 1 error.
    pub fn plan(&self) -> Output {
        self.tf(&["plan", "-detailed-exitcode", "-no-color", "-input=false"])
    }

    /// No resource changes. An output may still change: one that reads a group's
    /// live `nodes` moves when the daemon (or a test through the engine) scales;
    /// that is reported as an output change only.
    pub fn assert_plan_empty(&self, when: &str) {
        let o = self.plan();
        assert!(
            o.code == 0
                || (o.code == 2
                    && !o.stdout.contains("Plan:")
                    && o.stdout.contains("Changes to Outputs")),
            "plan after {when} is not empty:\n{}",
            o.all()
        );
    }

    pub fn destroy(&mut self) -> Output {
        let o = self.tf(&["destroy", "-auto-approve", "-no-color", "-input=false"]);
        assert_eq!(o.code, 0, "terraform destroy failed:\n{}", o.all());
        self.applied = false;
        o
    }

    /// The JSON of `terraform output -json`, after a refresh (a group's live
    /// `nodes` move when it scales between applies).
    pub fn outputs(&self) -> Value {
        let o = self.tf(&[
            "apply",
            "-refresh-only",
            "-auto-approve",
            "-no-color",
            "-input=false",
        ]);
        assert_eq!(o.code, 0, "terraform refresh failed:\n{}", o.all());
        let o = self.tf(&["output", "-json"]);
        assert_eq!(o.code, 0, "terraform output failed:\n{}", o.all());
        serde_json::from_str(&o.stdout).expect("output json")
    }

    /// The values of a resource in the state (`terraform show -json`).
    pub fn resource(&self, address: &str) -> Value {
        let o = self.tf(&["show", "-json"]);
        assert_eq!(o.code, 0, "terraform show failed:\n{}", o.all());
        let v: Value = serde_json::from_str(&o.stdout).expect("show json");
        v["values"]["root_module"]["resources"]
            .as_array()
            .and_then(|rs| rs.iter().find(|r| r["address"] == address))
            .map(|r| r["values"].clone())
            .unwrap_or(Value::Null)
    }

    /// Forgets a resource and imports it again by name; the plan after must be empty.
    pub fn reimport(&self, address: &str, name: &str) {
        let o = self.tf(&["state", "rm", address]);
        assert_eq!(o.code, 0, "state rm failed:\n{}", o.all());
        let o = self.tf(&["import", "-no-color", "-input=false", address, name]);
        assert_eq!(o.code, 0, "import of {address} failed:\n{}", o.all());
        // `state rm` also drops the outputs that read the resource.
        self.assert_plan_empty(&format!("importing {address}"));
    }

    /// The store of this workspace, through the engine's test accessor: for
    /// what no engine method shows (rows left behind, the backend in use).
    /// Groups, nodes and events are read through [`Workspace::engine`].
    pub fn store(&self) -> Arc<lbscale_engine::store::Store> {
        self.engine().testing_store().clone()
    }

    /// The engine on this workspace's store and local cloud, as the daemon opens
    /// it: to scale a group outside Terraform.
    pub fn engine(&self) -> lbscale_engine::Engine {
        let settings = lbscale_cloud_local::LocalSettings {
            address_prefix: self.prefix.clone(),
            node_binary: Some(bin_dir().join("lbscale-node")),
            ..Default::default()
        };
        let url = self
            .state
            .as_deref()
            .unwrap_or("sqlite://.lbscale/state.db");
        let clouds = lbscale_engine::cloud::Clouds::new()
            .with("local", lbscale_cloud_local::drivers(settings));
        lbscale_engine::Engine::open(url, &self.dir, clouds).expect("open the engine")
    }

    /// A node's statistics, read from its management API with the group's token
    /// (as the daemon reads them).
    pub async fn node_stats(
        &self,
        node: &lbscale_engine::store::NodeRow,
    ) -> lbscale_engine::nodeapi::NodeStats {
        let token = self.engine().group_token(&node.group_id).unwrap();
        assert!(!token.is_empty(), "group {} has no token", node.group_id);
        let port = node
            .handle
            .get("api_port")
            .and_then(|p| p.as_u64())
            .expect("the node's API port") as u16;
        let mut c =
            lbscale_engine::nodeapi::NodeClient::connect(&node.private_ip, port, &node.id, &token)
                .await
                .expect("connect to the node's API");
        c.stats().await.expect("GetStats")
    }

    /// Running (not zombie) processes whose command line mentions this workspace.
    pub fn processes(&self) -> Vec<(u32, String)> {
        let needle = self.dir.display().to_string();
        let mut out = Vec::new();
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) else {
                continue;
            };
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            let zombie = std::fs::read_to_string(entry.path().join("stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')
                        .map(|(_, r)| r.trim_start().starts_with('Z'))
                })
                .unwrap_or(true);
            if cmd.contains(&needle) && !zombie && pid != std::process::id() {
                out.push((pid, cmd));
            }
        }
        out
    }

    /// Whether anything listens on `ip:port`.
    pub fn listening(ip: &str, port: u16) -> bool {
        let addr: SocketAddr = format!("{ip}:{port}").parse().unwrap();
        TcpStream::connect_timeout(&addr, Duration::from_millis(300)).is_ok()
    }

    /// Asserts that destroy left nothing: no process, no listening socket at the
    /// given addresses, no row in the store.
    pub fn assert_nothing_left(&self, addresses: &[(String, u16)]) {
        let procs = self.processes();
        assert!(procs.is_empty(), "processes left after destroy: {procs:?}");
        for (ip, port) in addresses {
            assert!(
                !Self::listening(ip, *port),
                "{ip}:{port} still listening after destroy"
            );
        }
        let store = self.store();
        for table in [
            "distributors",
            "groups",
            "se_groups",
            "vservers",
            "nodes",
            "events",
            "addresses",
            "group_secrets",
            "policy_state",
            "vserver_spans",
        ] {
            let n = store.count_rows(table).unwrap();
            assert_eq!(n, 0, "{n} row(s) left in {table} after destroy");
        }
    }
}

impl Drop for Workspace {
    fn drop(&mut self) {
        if self.applied {
            let _ = self.tf(&["destroy", "-auto-approve", "-no-color", "-input=false"]);
        }
        for (pid, _) in self.processes() {
            unsafe {
                libc_kill(pid as i32, SIGKILL);
            }
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// SIGKILL to `pid`, as a crash.
pub fn sigkill(pid: u32) {
    unsafe {
        libc_kill(pid as i32, SIGKILL);
    }
}

/// A backend HTTP server on 127.0.0.1 that answers every request with `name`
/// in its body and an `x-backend` header. Runs until the test process ends.
pub fn http_backend(name: &str) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let name = name.to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let name = name.clone();
            std::thread::spawn(move || serve_http(stream, &name));
        }
    });
    port
}

fn serve_http(mut s: TcpStream, name: &str) {
    use std::io::{BufRead, BufReader, Write};
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let mut reader = BufReader::new(s.try_clone().unwrap());
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut content_length = 0usize;
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            if h == "\r\n" || h == "\n" {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    content_length = v.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0u8; content_length];
        if content_length > 0 && std::io::Read::read_exact(&mut reader, &mut body).is_err() {
            return;
        }
        let reply = format!("{name}\n");
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nx-backend: {name}\r\nconnection: keep-alive\r\n\r\n{reply}",
            reply.len()
        );
        if s.write_all(resp.as_bytes()).is_err() {
            return;
        }
    }
}

/// A TCP backend on 127.0.0.1 that writes `name` then echoes what it reads.
pub fn tcp_backend(name: &str) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let greeting = format!("{name}\n");
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let greeting = greeting.clone();
            std::thread::spawn(move || {
                use std::io::{Read, Write};
                let _ = stream.write_all(greeting.as_bytes());
                let mut buf = [0u8; 1024];
                while let Ok(n) = stream.read(&mut buf) {
                    if n == 0 || stream.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    port
}

/// An HTTP response: status, headers (names in lower case), body.
pub type HttpResponse = (u16, Vec<(String, String)>, String);

/// One HTTP/1.1 GET to `ip:port` with `Host: host`; returns (status, headers, body).
pub fn http_get(ip: &str, port: u16, host: &str) -> Result<HttpResponse, String> {
    use std::io::{Read, Write};
    let addr: SocketAddr = format!("{ip}:{port}").parse().map_err(|e| format!("{e}"))?;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(3))
        .map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .map_err(|e| format!("read from {addr}: {e}"))?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no HTTP response from {addr}: {text:?}"))?;
    let mut lines = head.lines();
    let status: u16 = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("bad status line from {addr}"))?;
    let headers = lines
        .filter_map(|l| {
            l.split_once(':')
                .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        })
        .collect();
    Ok((status, headers, body.to_string()))
}

pub fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// A real DNS query with `dig` to the distributor's server: the A records.
pub fn dig(server: &str, name: &str) -> Vec<String> {
    let (ip, port) = server.rsplit_once(':').expect("IP:PORT");
    let out = Command::new("dig")
        .args([
            &format!("@{ip}"),
            "-p",
            port,
            name,
            "A",
            "+short",
            "+time=2",
            "+tries=2",
        ])
        .output()
        .expect("run dig (apt-get install dnsutils)");
    let mut v: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim().to_string())
        .filter(|l| !l.is_empty())
        .collect();
    v.sort();
    v
}

/// Polls `f` until it returns `Some`, at most `timeout`; panics naming `what`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    wait_showing(what, timeout, || f().ok_or("nothing"))
}

/// As [`wait_for`], where `f` says what it saw instead: a timeout names the
/// last thing seen, so that a failure in CI says how far it got.
pub fn wait_showing<T, S: std::fmt::Debug>(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Result<T, S>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        let seen = match f() {
            Ok(v) => return v,
            Err(seen) => seen,
        };
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}; last seen: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The 1-based line of `needle` in the workspace's main.tf (to check that a
/// diagnostic points at the right attribute).
pub fn line_of(ws: &Workspace, needle: &str) -> usize {
    let text = std::fs::read_to_string(ws.dir.join("main.tf")).unwrap();
    text.lines()
        .position(|l| l.contains(needle))
        .map(|i| i + 1)
        .unwrap_or_else(|| panic!("{needle:?} not in main.tf"))
}

/// One diagnostic as Terraform prints it in text form.
#[derive(Debug, Clone)]
pub struct Diag {
    pub severity: String,
    pub summary: String,
    /// The configuration line it points at.
    pub line: Option<usize>,
    /// The whole text, whitespace collapsed (Terraform wraps lines at 78 columns).
    pub text: String,
}

/// The diagnostics in Terraform's text output.
pub fn diagnostics(output: &str) -> Vec<Diag> {
    let mut out: Vec<Diag> = Vec::new();
    for line in output.lines() {
        let t = line.trim_start_matches(['│', '╷', '╵', ' ']);
        let starts = [("Error: ", "error"), ("Warning: ", "warning")]
            .into_iter()
            .find(|(p, _)| t.starts_with(p));
        if let Some((p, sev)) = starts {
            out.push(Diag {
                severity: sev.into(),
                summary: t[p.len()..].trim().into(),
                line: None,
                text: String::new(),
            });
            continue;
        }
        let Some(d) = out.last_mut() else { continue };
        if d.line.is_none() {
            if let Some(rest) = t.strip_prefix("on main.tf line ") {
                d.line = rest
                    .split(|c: char| !c.is_ascii_digit())
                    .next()
                    .and_then(|n| n.parse().ok());
            }
        }
        d.text.push(' ');
        d.text.push_str(t);
    }
    for d in &mut out {
        d.text = d.text.split_whitespace().collect::<Vec<_>>().join(" ");
    }
    out
}

impl Workspace {
    /// Runs terraform with extra environment variables.
    pub fn tf_env(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        let mut cmd = Command::new(&self.terraform);
        cmd.args(args)
            .current_dir(&self.dir)
            .env("TF_CLI_CONFIG_FILE", &self.cli_config)
            .env("CHECKPOINT_DISABLE", "1")
            .env("TF_IN_AUTOMATION", "1")
            .env_remove("TF_LOG");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = output_within(
            &mut cmd,
            TERRAFORM_LIMIT,
            &format!("terraform {}", args.join(" ")),
        );
        Output {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

// --- for the daemon tests ---------------------------------------------------------

/// A backend that answers every request with a 64 KiB body.
pub fn big_backend() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || serve_big(stream));
        }
    });
    port
}

fn serve_big(mut s: TcpStream) {
    use std::io::{BufRead, BufReader};
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let body = vec![b'x'; 64 * 1024];
    let mut reader = BufReader::new(s.try_clone().unwrap());
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            if h == "\r\n" || h == "\n" {
                break;
            }
        }
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: keep-alive\r\n\r\n",
            body.len()
        );
        if s.write_all(head.as_bytes()).is_err() || s.write_all(&body).is_err() {
            return;
        }
    }
}

/// HTTP GETs of a 64 KiB body through `ip:8080`, two threads, ~50 requests/s
/// each (tens of Mbps), until stopped or dropped; `stop` returns the full answers.
/// [`Load::start_with`] sets the threads and the pause between requests.
pub struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    pub fn start(ip: &str, host: &str) -> Load {
        Load::start_with(ip, host, 2, Duration::from_millis(20))
    }
    pub fn start_with(ip: &str, host: &str, threads: usize, pause: Duration) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let threads = (0..threads)
            .map(|_| {
                let (stop, ok) = (stop.clone(), ok.clone());
                let (ip, host) = (ip.to_string(), host.to_string());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        if let Ok((200, _, body)) = http_get(&ip, 8080, &host) {
                            if body.len() >= 64 * 1024 {
                                ok.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        std::thread::sleep(pause);
                    }
                })
            })
            .collect();
        Load { stop, ok, threads }
    }
    pub fn stop(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.ok.load(Ordering::Relaxed)
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

pub fn daemon_get(port: u16, path: &str) -> Result<(u16, String), String> {
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut s =
        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).map_err(|e| e.to_string())?;
    let (head, body) = raw.split_once("\r\n\r\n").ok_or("no response")?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or("bad status line")?;
    Ok((code, body.to_string()))
}

/// The daemon tests' stack: one AZ, min 1, scaled on throughput per node (out
/// above 8 Mbps, which the load generator moves; in below 1 Mbps, idle), with
/// intervals of seconds.
pub fn daemon_stack(name: &str, backend: u16, max_nodes: u32, cooldown: &str) -> String {
    format!(
        r#"
resource "lbscale_traffic_distributor" "d" {{
  name   = "{name}-dns"
  cloud  = "local"
  mode   = "dns"
  domain = "{name}.lbscale.test"
  ttl    = "1s"
}}

resource "lbscale_autoscale_group" "g" {{
  name                   = "{name}"
  cloud                  = "local"
  availability_zones     = ["az1"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = 1
  max_nodes              = {max_nodes}
  stats_interval         = "1s"
  watch_time             = "2s"
  cooldown               = "{cooldown}"
  drain_timeout          = "2s"
  threshold {{
    metric = "throughput"
    min    = 1
    max    = 8
  }}
}}

resource "lbscale_se_group" "s" {{
  name               = "{name}-se"
  autoscale_group_id = lbscale_autoscale_group.g.id
}}

resource "lbscale_vserver" "web" {{
  name         = "{name}-web"
  se_group_id  = lbscale_se_group.s.id
  service_type = "HTTP"
  port         = 8080
  service {{
    name    = "big"
    address = "127.0.0.1"
    port    = {backend}
  }}
}}

output "dns" {{ value = lbscale_traffic_distributor.d.address["dns"] }}
"#
    )
}

/// A running `lbscale daemon` on a workspace's store, with its HTTP API on
/// `127.0.0.1:port` and its log (JSON lines) in the workspace; killed
/// (SIGKILL) when dropped, and its log printed if the test is failing.
pub struct Daemon {
    child: Option<std::process::Child>,
    pub port: u16,
    pub log: PathBuf,
}

impl Daemon {
    /// Starts a daemon and waits (at most 10 s) for its `/healthz`.
    pub fn start(ws: &Workspace, port: u16, tag: &str) -> Daemon {
        Daemon::start_with(ws, port, tag, &[])
    }

    /// As [`Daemon::start`], with extra environment (`LBSCALE_FAULT`, ...). The
    /// store is the workspace's: through `LBSCALE_STATE` if the workspace gives
    /// it to the provider that way, else `--state`.
    pub fn start_with(ws: &Workspace, port: u16, tag: &str, env: &[(&str, &str)]) -> Daemon {
        Daemon::start_using(ws, port, tag, env, &bin_dir().join("lbscale-node"))
    }

    /// As [`Daemon::start_with`], with the nodes it provisions started from
    /// `node_binary`.
    pub fn start_using(
        ws: &Workspace,
        port: u16,
        tag: &str,
        env: &[(&str, &str)],
        node_binary: &Path,
    ) -> Daemon {
        let log = ws.dir.join(format!("daemon-{tag}.log"));
        let mut cmd = Command::new(bin_dir().join("lbscale"));
        cmd.arg("daemon");
        let state_env = lbscale_engine::store::STATE_URL_ENV;
        cmd.env_remove(state_env).env_remove("LBSCALE_FAULT");
        match (&ws.state, ws.state_from_env) {
            (Some(url), true) => {
                cmd.env(state_env, url);
            }
            (url, _) => {
                cmd.args([
                    "--state",
                    url.as_deref().unwrap_or("sqlite://.lbscale/state.db"),
                ]);
            }
        }
        cmd.args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--address-prefix",
            &ws.prefix,
            "--node-binary",
            node_binary.to_str().unwrap(),
            "--log-format",
            "json",
        ])
        .current_dir(&ws.dir)
        .env("LBSCALE_LOG", "info")
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
        let child = cmd.spawn().expect("start lbscale daemon");
        let d = Daemon {
            child: Some(child),
            port,
            log,
        };
        wait_for("the daemon's /healthz", Duration::from_secs(10), || {
            matches!(d.get("/healthz"), Ok((200, ref b)) if b == "ok\n").then_some(())
        });
        d
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("the daemon runs").id()
    }

    pub fn get(&self, path: &str) -> Result<(u16, String), String> {
        daemon_get(self.port, path)
    }

    /// GET `path`, which must answer 200 with JSON.
    pub fn json(&self, path: &str) -> Value {
        let (code, body) = self.get(path).unwrap();
        assert_eq!(code, 200, "GET {path}: {body}");
        serde_json::from_str(&body).unwrap()
    }

    /// The group `name` as `/v1/groups` shows it (`Null` if absent).
    pub fn group(&self, name: &str) -> Value {
        self.json("/v1/groups")["groups"]
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["name"] == name)
            .cloned()
            .unwrap_or(Value::Null)
    }

    pub fn metrics(&self) -> String {
        self.get("/metrics").unwrap().1
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM; the daemon must exit 0 within 15 s.
    pub fn stop(mut self) {
        let mut child = self.child.take().unwrap();
        unsafe { libc_kill(child.id() as i32, SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                assert!(
                    status.success(),
                    "daemon exited with {status}:\n{}",
                    self.logs()
                );
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the daemon did not exit within 15 s of SIGTERM:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL, as a crash.
    pub fn crash(mut self) {
        if let Some(mut c) = self.child.take() {
            unsafe { libc_kill(c.id() as i32, SIGKILL) };
            let _ = c.wait();
        }
    }

    /// Waits (bounded) for the daemon to exit by itself, and returns how;
    /// `None` if it still runs after `within` (dropping it then kills it).
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let child = self.child.as_mut().expect("the daemon runs");
        let deadline = Instant::now() + within;
        loop {
            if let Some(s) = child.try_wait().unwrap() {
                self.child = None;
                return Some(s);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            unsafe { libc_kill(c.id() as i32, SIGKILL) };
            let _ = c.wait();
            if std::thread::panicking() {
                eprintln!("--- daemon log {} ---\n{}", self.log.display(), self.logs());
            }
        }
    }
}

const SIGKILL: i32 = 9;
const SIGTERM: i32 = 15;
