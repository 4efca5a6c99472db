//! The docs stay usable: README.md within 250 lines, its example the one the crate doc and
//! `cargo run --example store` run, every relative link in the Markdown a user or contributor
//! reads resolving (files and `#anchors`), and no dates in them (git keeps the history). The
//! README's and docs/guide.md's Rust blocks themselves run as doctests (`src/lib.rs`).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

const README_MAX_LINES: usize = 250;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The Markdown files the check covers: the top-level ones and every file under docs/.
fn markdown_files() -> Vec<PathBuf> {
    let r = root();
    let mut files: Vec<PathBuf> = [
        "README.md",
        "CONTRIBUTING.md",
        "CHANGELOG.md",
        "bench-results/README.md",
        "examples/README.md",
        "tests/README.md",
    ]
    .iter()
    .map(|f| r.join(f))
    .collect();
    let mut docs: Vec<PathBuf> = std::fs::read_dir(r.join("docs"))
        .expect("docs/ exists")
        .map(|e| e.expect("a readable entry of docs/").path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The lines of `text` outside fenced code blocks.
fn outside_fences(text: &str) -> impl Iterator<Item = &str> {
    let mut fenced = false;
    text.lines().filter(move |line| {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            return false;
        }
        !fenced
    })
}

/// Lines outside fenced code blocks, with inline code spans blanked out.
fn prose_lines(text: &str) -> Vec<String> {
    outside_fences(text)
        .map(|line| {
            let mut in_code = false;
            line.chars()
                .map(|c| {
                    if c == '`' {
                        in_code = !in_code;
                        ' '
                    } else if in_code {
                        ' '
                    } else {
                        c
                    }
                })
                .collect()
        })
        .collect()
}

/// The targets of `[text](target)` links in `text`, outside code.
fn links(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in prose_lines(text) {
        let mut rest = line.as_str();
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            found.push(after[..end].trim().to_owned());
            rest = &after[end..];
        }
    }
    found
}

/// GitHub's anchor for a heading: lower case, punctuation dropped (but `-` and `_`), spaces as
/// hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown file's headings (outside code blocks).
fn anchors(text: &str) -> HashSet<String> {
    outside_fences(text)
        .filter(|line| line.starts_with('#'))
        .map(|line| slug(line.trim_start_matches('#')))
        .collect()
}

#[test]
fn the_readme_stays_within_its_length() {
    let lines = read(&root().join("README.md")).lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: move the depth to docs/"
    );
}

#[test]
fn the_readme_shows_the_example_the_crate_doc_runs() {
    let readme = read(&root().join("README.md"));
    let example = read(&root().join("examples/store.rs"));
    let block = format!("```rust\n{example}```\n");
    assert!(
        readme.contains(&block),
        "README.md must show examples/store.rs whole, in a ```rust block (the crate doc includes that file)"
    );
}

#[test]
fn every_relative_link_resolves() {
    let mut broken = Vec::new();
    for file in markdown_files() {
        let text = read(&file);
        let dir = file.parent().expect("a file has a directory");
        for target in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (target.as_str(), None),
            };
            let resolved = if path.is_empty() { file.clone() } else { dir.join(path) };
            if !resolved.exists() {
                broken.push(format!("{}: {target} (no such file)", file.display()));
                continue;
            }
            if let Some(a) = anchor {
                if resolved.extension().is_some_and(|x| x == "md") && !anchors(&read(&resolved)).contains(a) {
                    broken.push(format!("{}: {target} (no such heading)", file.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_docs_carry_no_dates() {
    let mut dated = Vec::new();
    for file in markdown_files() {
        for (n, line) in read(&file).lines().enumerate() {
            let b = line.as_bytes();
            let is_date = (0..b.len().saturating_sub(9)).any(|i| {
                let w = &b[i..i + 10];
                w[..4].iter().all(u8::is_ascii_digit)
                    && w[4] == b'-'
                    && w[5..7].iter().all(u8::is_ascii_digit)
                    && w[7] == b'-'
                    && w[8..].iter().all(u8::is_ascii_digit)
            });
            if is_date {
                dated.push(format!("{}:{}: {line}", file.display(), n + 1));
            }
        }
    }
    assert!(
        dated.is_empty(),
        "docs say how things are; git keeps the history:\n{}",
        dated.join("\n")
    );
}

#[test]
fn the_link_and_anchor_rules_work() {
    assert_eq!(
        slug(" Payloads: `Vec`, `Bulk`, bodies and registered buffers"),
        "payloads-vec-bulk-bodies-and-registered-buffers"
    );
    assert_eq!(slug(" The eager/rendezvous threshold"), "the-eagerrendezvous-threshold");
    assert_eq!(
        links("see [a](x.md#y) and `[not](a link)`\n```\n[no](z)\n```\n[b](#c)"),
        ["x.md#y", "#c"]
    );
}
