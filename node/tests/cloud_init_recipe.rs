//! The image recipe of examples/cloud-init: its install script, run into a
//! temporary root against this build's lbscale-node served on loopback,
//! installs the binary (raw, or from a release zip) only when its SHA-256 is
//! the one given, installs and enables a unit that `systemd-analyze verify`
//! accepts, and the unit's ExecStart line, run as systemd would run it, starts
//! a node whose API answers. The cloud-config carries the script word for word.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use common::{api_client_with, api_files, tmpdir, API_NODE, BIN};
use lbscale_proto::StatsRequest;
use sha2::{Digest, Sha256};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

const SCRIPT: &str = "examples/cloud-init/install-lbscale-node.sh";
const USER_DATA: &str = "examples/cloud-init/user-data.yaml";
const UNIT: &str = "etc/systemd/system/lbscale-node.service";
const INSTALLED: &str = "usr/local/bin/lbscale-node";

/// Serves the files of `dir` over HTTP/1.0 on a loopback port, until the
/// test ends; returns the base URL.
fn serve_dir(dir: &Path) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let dir = dir.to_path_buf();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
            let mut line = String::new();
            let mut r = BufReader::new(conn.try_clone().unwrap());
            if r.read_line(&mut line).is_err() {
                continue;
            }
            // The rest of the request head.
            let mut h = String::new();
            while r.read_line(&mut h).is_ok_and(|n| n > 2) {
                h.clear();
            }
            let path = line.split_whitespace().nth(1).unwrap_or("/");
            let answer = match std::fs::read(dir.join(path.trim_start_matches('/'))) {
                Ok(body) => {
                    let mut a =
                        format!("HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n", body.len())
                            .into_bytes();
                    a.extend(body);
                    a
                }
                Err(_) => b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n".to_vec(),
            };
            let _ = conn.write_all(&answer);
        }
    });
    base
}

fn sha256_hex(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap();
    Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The release zip's layout: lbscale-node beside the provider.
fn make_zip(binary: &Path, zip: &Path) {
    let out = Command::new("python3")
        .arg("-c")
        .arg(
            "import sys, zipfile\n\
             with zipfile.ZipFile(sys.argv[2], 'w', zipfile.ZIP_DEFLATED) as z:\n\
             \x20   z.writestr('terraform-provider-lbscale_v0.1.0', b'provider')\n\
             \x20   z.write(sys.argv[1], 'lbscale-node')\n",
        )
        .arg(binary)
        .arg(zip)
        .output()
        .expect("python3 (scripts/setup.sh installs it)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn install(root: &Path, url: &str, sha256: &str) -> Output {
    Command::new("sh")
        .arg(repo(SCRIPT))
        .args([url, sha256])
        .env("ROOT", root)
        .output()
        .unwrap()
}

fn fails_saying(out: &Output, says: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains(says),
        "expected a failure saying {says:?}: {err}"
    );
}

/// The served files: the binary, and a release zip holding it.
fn release(tag: &str) -> (PathBuf, String) {
    let srv = tmpdir(&format!("recipe-srv-{tag}"));
    std::fs::copy(BIN, srv.join("lbscale-node")).unwrap();
    make_zip(&srv.join("lbscale-node"), &srv.join("release.zip"));
    let base = serve_dir(&srv);
    (srv, base)
}

#[test]
fn a_wrong_or_malformed_hash_installs_nothing() {
    let (srv, base) = release("refused");
    let root = tmpdir("recipe-refused");
    let right = sha256_hex(&srv.join("lbscale-node"));
    let mut wrong = right.clone().into_bytes();
    wrong[0] = if wrong[0] == b'0' { b'1' } else { b'0' };
    let wrong = String::from_utf8(wrong).unwrap();
    let url = format!("{base}/lbscale-node");
    let out = install(&root, &url, &wrong);
    fails_saying(
        &out,
        &format!("SHA-256 mismatch for {url}: expected {wrong}, got {right}; nothing installed"),
    );
    fails_saying(
        &install(&root, &url, "abc"),
        "SHA256 must be 64 hex digits, got \"abc\"",
    );
    fails_saying(
        &install(&root, &format!("{base}/missing"), &right),
        "cannot download",
    );
    fails_saying(
        &install(&root, "ftp://example.com/x", &right),
        "URL must start with https://",
    );
    // The zip's hash is the zip's, not the binary's.
    fails_saying(
        &install(&root, &format!("{base}/release.zip"), &right),
        "SHA-256 mismatch",
    );
    let left: Vec<_> = walk(&root);
    assert!(left.is_empty(), "a refused install left {left:?}");
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() && !p.is_symlink() {
            out.extend(walk(&p));
        }
        out.push(p);
    }
    out
}

/// The unit's `Key=` values.
fn values<'a>(unit: &'a str, key: &str) -> Vec<&'a str> {
    unit.lines()
        .filter_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .collect()
}

/// `systemd-analyze verify` on the unit, its ExecStart pointed at the
/// installed binary (verify checks that it exists and is executable).
fn verify(root: &Path, unit: &str) {
    let analyze = ["/usr/bin/systemd-analyze", "/bin/systemd-analyze"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .expect(
            "systemd-analyze is missing: install Debian's systemd package (scripts/setup.sh does)",
        );
    let dir = tmpdir("recipe-verify");
    let path = dir.join("lbscale-node.service");
    let installed = root.join(INSTALLED);
    std::fs::write(
        &path,
        unit.replace(
            "ExecStart=/usr/local/bin/lbscale-node ",
            &format!("ExecStart={} ", installed.display()),
        ),
    )
    .unwrap();
    let out = Command::new(&analyze)
        .args(["verify", "--man=no"])
        .arg(&path)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // verify only warns about an unknown key or a bad value: any line about
    // the unit is a failure.
    let about: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("lbscale-node.service"))
        .collect();
    assert!(
        out.status.success() && about.is_empty(),
        "systemd-analyze verify: {:?}\n{err}",
        out.status
    );
    // The sandbox, as systemd rates it: exposure at most 2.0 of 10.
    let out = Command::new(analyze)
        .args(["security", "--offline=true", "--threshold=20", "--no-pager"])
        .arg(&path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let overall = text
        .lines()
        .find(|l| l.contains("Overall exposure level"))
        .unwrap_or("");
    assert!(
        out.status.success(),
        "systemd-analyze security rates the unit above 2.0: {overall}"
    );
}

/// The unit's ExecStart as systemd runs it: `${VAR}` from the environment
/// file, `%d` the credentials directory (here the files themselves, which is
/// what systemd copies there), the binary under `root`.
fn exec_start(root: &Path, unit: &str) -> Vec<String> {
    let exec = values(unit, "ExecStart");
    assert_eq!(exec.len(), 1, "one ExecStart: {exec:?}");
    let env_file = values(unit, "EnvironmentFile");
    assert_eq!(env_file, ["/etc/lbscale/node.env"]);
    let env = std::fs::read_to_string(root.join("etc/lbscale/node.env")).unwrap();
    let var = |name: &str| -> String {
        env.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix('='))
            .unwrap_or_else(|| panic!("node.env has no {name}"))
            .to_string()
    };
    // Every credential named by %d is one LoadCredential brings.
    let creds: Vec<&str> = values(unit, "LoadCredential");
    exec[0]
        .split_whitespace()
        .map(|w| {
            if let Some(name) = w.strip_prefix("${").and_then(|w| w.strip_suffix('}')) {
                var(name)
            } else if let Some(file) = w.strip_prefix("%d/") {
                let from = creds
                    .iter()
                    .find_map(|c| c.strip_prefix(file)?.strip_prefix(':'))
                    .unwrap_or_else(|| panic!("no LoadCredential={file}:… for {w}"));
                root.join(from.trim_start_matches('/'))
                    .display()
                    .to_string()
            } else if w.starts_with('/') {
                root.join(w.trim_start_matches('/')).display().to_string()
            } else {
                w.to_string()
            }
        })
        .collect()
}

struct Node(Child);

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recipe_installs_a_node_that_starts_and_answers() {
    let (srv, base) = release("installs");
    for (file, root) in [
        ("lbscale-node", "recipe-raw"),
        ("release.zip", "recipe-zip"),
    ] {
        let root = tmpdir(root);
        let out = install(
            &root,
            &format!("{base}/{file}"),
            &sha256_hex(&srv.join(file)).to_uppercase(),
        );
        assert!(
            out.status.success(),
            "{file}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            std::fs::read(root.join(INSTALLED)).unwrap(),
            std::fs::read(BIN).unwrap(),
            "{file}: the installed binary is the one served"
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &str| {
            std::fs::metadata(root.join(p))
                .unwrap()
                .permissions()
                .mode()
                & 0o777
        };
        assert_eq!(
            (mode(INSTALLED), mode(UNIT), mode("etc/lbscale")),
            (0o755, 0o644, 0o700)
        );
        let wants = root.join("etc/systemd/system/multi-user.target.wants/lbscale-node.service");
        assert_eq!(
            std::fs::read_link(wants).unwrap(),
            Path::new("/etc/systemd/system/lbscale-node.service"),
            "enabled"
        );
        let unit = std::fs::read_to_string(root.join(UNIT)).unwrap();
        verify(&root, &unit);
        if file != "release.zip" {
            continue;
        }

        // First boot: the node's user data writes its settings and API files.
        let etc = root.join("etc/lbscale");
        let ip = "127.95.5.1";
        std::fs::write(
            etc.join("node.env"),
            format!(
                "LBSCALE_NODE_ID=imaged-node\nLBSCALE_LISTEN_IP={ip}\nLBSCALE_API_ADDRESS={ip}\nLBSCALE_API_PORT=7070\n"
            ),
        )
        .unwrap();
        api_files(&etc, API_NODE, None);
        let argv = exec_start(&root, &unit);
        assert_eq!(argv[0], root.join(INSTALLED).display().to_string());
        let mut node = Node(
            Command::new(&argv[0])
                .args(&argv[1..])
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(std::fs::File::create(root.join("node.log")).unwrap())
                .spawn()
                .unwrap(),
        );
        let mut ready = String::new();
        let stdout = node.0.stdout.take().unwrap();
        let waited = tokio::task::spawn_blocking(move || {
            let _ = BufReader::new(stdout).read_line(&mut ready);
            ready
        });
        let ready = tokio::time::timeout(Duration::from_secs(10), waited)
            .await
            .expect("the node's `ready` line within 10 s")
            .unwrap();
        let mut log = String::new();
        let _ = std::fs::File::open(root.join("node.log")).map(|mut f| f.read_to_string(&mut log));
        assert_eq!(ready.trim(), "ready", "{argv:?}\n{log}");
        let token = lbscale_engine::nodeapi::auth::node_token(common::SECRET, API_NODE);
        let mut cl = api_client_with(&format!("{ip}:7070"), API_NODE, Some(&token)).await;
        let st = tokio::time::timeout(
            Duration::from_secs(5),
            cl.get_stats(StatsRequest::default()),
        )
        .await
        .expect("GetStats within 5 s")
        .expect("GetStats")
        .into_inner();
        assert_eq!(
            (st.node_id.as_str(), st.stats_source.as_str()),
            ("imaged-node", "instance")
        );
    }
}

/// The block scalar under `content: |` of the cloud-config's first file.
fn embedded_script(user_data: &str) -> String {
    let mut lines = user_data
        .lines()
        .skip_while(|l| l.trim() != "content: |")
        .skip(1);
    let first = lines.next().expect("a content: | block");
    let indent = first.len() - first.trim_start().len();
    let mut out = format!("{}\n", &first[indent..]);
    for l in lines {
        if !l.trim().is_empty() && l.len() - l.trim_start().len() < indent {
            break;
        }
        out.push_str(l.get(indent..).unwrap_or(""));
        out.push('\n');
    }
    // A block scalar keeps one final newline ("clip").
    format!("{}\n", out.trim_end_matches('\n'))
}

#[test]
fn the_cloud_config_carries_the_script_and_runs_it() {
    let user_data = std::fs::read_to_string(repo(USER_DATA)).unwrap();
    assert!(user_data.starts_with("#cloud-config\n"));
    assert_eq!(
        embedded_script(&user_data),
        std::fs::read_to_string(repo(SCRIPT)).unwrap(),
        "{USER_DATA} must carry {SCRIPT} word for word"
    );
    assert!(user_data.contains("  - path: /usr/local/sbin/install-lbscale-node\n"));
    let run = user_data
        .lines()
        .skip_while(|l| *l != "runcmd:")
        .nth(1)
        .expect("a runcmd line");
    assert!(
        run.starts_with("  - /usr/local/sbin/install-lbscale-node \"https://")
            && run.ends_with("&& systemctl poweroff"),
        "{run}"
    );
}
