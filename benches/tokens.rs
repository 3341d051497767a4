//! Token counting of a tool result the counter has not seen (a cold request counts every
//! message once): ASCII text, which the pre-tokenization splits by hand, and the same text with
//! one non-ASCII character, which the split patterns' regex searches.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{Criterion, Throughput, criterion_group, criterion_main};

// The allocator the binary runs with (src/main.rs), so that the times are the binary's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use ctxproxy::tokens::Encoding;
use serde_json::json;

/// A database agent's query result, about 30 KB of JSON.
fn query_result() -> String {
    let rows: Vec<_> = (0..300)
        .map(|k| {
            json!({"customer_id": format!("C{k:05}"), "name": format!("Customer {k}"),
                "country": "Germany", "orders": k * 7 % 113, "revenue": format!("{}.{:02}", k * 37, k % 100),
                "last_order": format!("2024-0{}-1{}", k % 9 + 1, k % 10)})
        })
        .collect();
    serde_json::to_string_pretty(&rows).unwrap()
}

fn counting(c: &mut Criterion) {
    let ascii = query_result();
    let unicode = format!("{ascii}é");
    let mut group = c.benchmark_group("tokens");
    group.throughput(Throughput::Bytes(ascii.len() as u64));
    for (name, text) in [("count_ascii_30k", &ascii), ("count_unicode_30k", &unicode)] {
        // The text's pieces counted, with the thread's piece cache warm (as it is after a few
        // requests) and no count of the text itself kept anywhere.
        group.bench_function(name, |b| {
            b.iter(|| std::hint::black_box(Encoding::O200kBase.count(text)));
        });
    }
    group.finish();
}

criterion_group!(benches, counting);
criterion_main!(benches);
