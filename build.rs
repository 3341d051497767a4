//! Writes the BPE vocabularies the proxy embeds (o200k_base, cl100k_base) into `OUT_DIR`, each
//! beside a hash of its bytes: `tokens::vocabulary` reads them back from the binary's file and
//! checks them against that hash (see there for why).
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

fn write(out: &Path, name: &str, bpe: &bpe_openai::byte_pair_encoding::BytePairEncoding) {
    let bytes = rmp_serde::to_vec(bpe).expect("a vocabulary serializes");
    let mut hasher = DefaultHasher::new();
    hasher.write(&bytes);
    std::fs::write(out.join(format!("{name}.dict")), &bytes).expect("OUT_DIR is writable");
    std::fs::write(
        out.join(format!("{name}.hash")),
        format!("{}u64", hasher.finish()),
    )
    .expect("OUT_DIR is writable");
}
