//! The fuzz targets on stable, in every `cargo test`: each committed corpus input
//! (`rpc-core/fuzz/corpus/<target>/`) replayed, then mutations of them and random bytes.
//! libFuzzer itself (coverage-guided, nightly) runs in `scripts/fuzz.sh`.

#[allow(dead_code, unreachable_pub)]
#[path = "../rpc-core/fuzz/src/lib.rs"]
mod targets;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

type Target = fn(&[u8]);

const TARGETS: [(&str, Target); 4] = [
    ("frame", targets::frame),
    ("hello", targets::hello),
    ("request", targets::request),
    ("session", targets::session),
];

fn corpus(name: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("rpc-core/fuzz/corpus")
        .join(name);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    files.iter().map(|p| std::fs::read(p).expect("read")).collect()
}

fn run(name: &str, target: Target, input: &[u8], what: &str) {
    if catch_unwind(AssertUnwindSafe(|| target(input))).is_err() {
        panic!("fuzz target {name} panicked on {what}: {input:02x?}");
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn every_committed_corpus_input_still_passes() {
    for (name, target) in TARGETS {
        let inputs = corpus(name);
        assert!(!inputs.is_empty(), "the {name} corpus is empty");
        for (i, input) in inputs.iter().enumerate() {
            run(name, target, input, &format!("corpus input {i}"));
        }
    }
}

#[test]
fn mutated_and_random_inputs_never_panic() {
    let mut rng = Rng(0x5eed_1234_abcd_ef01);
    for (name, target) in TARGETS {
        let inputs = corpus(name);
        for round in 0..3000 {
            let mut input = if round % 3 == 0 || inputs.is_empty() {
                (0..rng.next() % 300).map(|_| rng.next() as u8).collect::<Vec<u8>>()
            } else {
                inputs[rng.next() as usize % inputs.len()].clone()
            };
            for _ in 0..1 + rng.next() % 4 {
                if input.is_empty() {
                    break;
                }
                let at = rng.next() as usize % input.len();
                match rng.next() % 3 {
                    0 => input[at] = rng.next() as u8,
                    1 => input.truncate(at),
                    _ => input.insert(at, rng.next() as u8),
                }
            }
            run(name, target, &input, &format!("mutation {round}"));
        }
    }
}
