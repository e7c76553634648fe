//! Every example under examples/ is valid for the provider as built.

use lbscale_acceptance::*;
use std::path::{Path, PathBuf};

fn example_dirs(root: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(root).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            example_dirs(&p, out);
        } else if p.extension().is_some_and(|x| x == "tf") && !out.contains(&root.to_path_buf()) {
            out.push(root.to_path_buf());
        }
    }
}

#[test]
fn every_example_validates() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    let mut dirs = Vec::new();
    example_dirs(&root, &mut dirs);
    assert!(
        dirs.len() >= 7,
        "expected an example per resource and data source, found {dirs:?}"
    );
    let ws = Workspace::new("examples", 118);
    for dir in dirs {
        for f in std::fs::read_dir(ws.dir.clone()).unwrap().flatten() {
            if f.path().extension().is_some_and(|x| x == "tf") {
                std::fs::remove_file(f.path()).unwrap();
            }
        }
        for f in std::fs::read_dir(&dir).unwrap().flatten() {
            if f.path().extension().is_some_and(|x| x == "tf") {
                std::fs::copy(f.path(), ws.dir.join(f.file_name())).unwrap();
            }
        }
        let o = ws.tf(&["validate", "-no-color"]);
        assert_eq!(
            o.code,
            0,
            "{} does not validate:\n{}",
            dir.display(),
            o.all()
        );
    }
}
