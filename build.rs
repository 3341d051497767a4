//! Writes the BPE vocabularies the proxy embeds (o200k_base, cl100k_base) into `OUT_DIR`, each
//! beside the hashes of its chunks: `tokens::vocabulary` reads them back from the binary's file
//! and checks every chunk against its hash before decoding it (see there for why).
#![allow(clippy::expect_used)] // a build that cannot write its vocabularies must stop

use std::hash::{DefaultHasher, Hasher};
use std::path::Path;

fn main() {
    let out = std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR for build scripts");
    let out = Path::new(&out);
    write(out, "o200k_base", &bpe_openai::o200k_base().bpe);
    write(out, "cl100k_base", &bpe_openai::cl100k_base().bpe);
    println!("cargo::rerun-if-changed=build.rs");
}

/// Bytes per hashed chunk of a vocabulary.
const CHUNK: usize = 64 * 1024;

fn write(out: &Path, name: &str, bpe: &bpe_openai::byte_pair_encoding::BytePairEncoding) {
    let bytes = rmp_serde::to_vec(bpe).expect("a vocabulary serializes");
    let hashes: Vec<String> = bytes
        .chunks(CHUNK)
        .map(|chunk| {
            let mut hasher = DefaultHasher::new();
            hasher.write(chunk);
            format!("{}u64", hasher.finish())
        })
        .collect();
    std::fs::write(out.join(format!("{name}.dict")), &bytes).expect("OUT_DIR is writable");
    std::fs::write(
        out.join(format!("{name}.chunks")),
        format!("({CHUNK}usize, &[{}])", hashes.join(", ")),
    )
    .expect("OUT_DIR is writable");
}
