//! The module graph drawn file by file has no circles (ARCHITECTURE.md, "Modules": dependencies
//! point down). Every `.rs` file under `src/` is read, each path it names into the crate (`use`
//! lines, grouped or not, and paths in the code: `crate::a::B`, `super::c`, `self::d`, a child
//! module's name) is resolved to the file that defines the module it reaches, and a loop among
//! files fails the test with the files and the imports that close it.
//!
//! A `#[cfg(test)]` module's paths are its own, not its file's: a test module imported by
//! nothing can close no loop, whether it is inline or in a file of its own, so moving one out
//! does not change the graph. A file's path to itself is not an edge (a `use super::*` in its inline `mod tests`), and
//! neither is a parent's path into its own descendants: `mod child;`, `pub use child::T`,
//! `child::run()`. A module is made of its children (a `mod.rs` declares, re-exports and
//! assembles them, and a child sees its parent's items), so that loop is the module tree
//! itself; what may not loop is the rest: a sibling or a cousin reached through `super::` or
//! `crate::`, and a child reaching up into a parent that imports, outside its own subtree,
//! something that imports the child. A path that names an item through a `pub use` reaches
//! both the re-exporting file and the file the item comes from (`crate::store::StoreConfig`
//! is `store/mod.rs` and `store/config.rs`): a re-export hides no loop, and importing a leaf
//! by its own path depends on the leaf alone. Paths outside the crate
//! (`std::`, `serde::`) are not followed. The reading is lexical, not a compiler's: comments,
//! strings and character literals are skipped, and a name is a module only where a file or an
//! inline `mod name { … }` declares it.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// A module's path from the crate root (`["pipeline", "tools"]`); the root is empty.
type ModPath = Vec<String>;

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    PathSep,
    Punct(char),
}

/// The tokens of `source` that matter for paths: identifiers, `::` and punctuation. Comments,
/// string, byte-string, raw-string and character literals and numbers are dropped, and a
/// lifetime is dropped with its quote.
fn tokens(source: &str) -> Vec<Token> {
    let chars: Vec<char> = source.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let n = chars.len();
    let at = |k: usize| chars.get(k).copied().unwrap_or('\0');
    while i < n {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '/' && at(i + 1) == '/' {
            while i < n && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < n {
                if chars[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if c == '"' {
            i = skip_string(&chars, i + 1);
        } else if c == '\'' {
            if at(i + 1) == '\\' {
                // An escaped character: skip to the closing quote.
                i += 2;
                while i < n && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                // A lifetime or a label: the name after it is not a path.
                i += 1;
                while i < n && (chars[i].is_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
            }
        } else if c.is_ascii_digit() {
            while i < n && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < n && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let prefix = matches!(word.as_str(), "r" | "br" | "b" | "c" | "cr");
            if prefix && (at(i) == '"' || (at(i) == '#' && matches!(at(i + 1), '"' | '#'))) {
                i = skip_prefixed_string(&chars, i, word.contains('r'));
            } else if word == "r" && at(i) == '#' {
                // A raw identifier (`r#type`).
                i += 1;
                let start = i;
                while i < n && (chars[i].is_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
                out.push(Token::Ident(chars[start..i].iter().collect()));
            } else if word == "b" && at(i) == '\'' {
                i = if at(i + 1) == '\\' {
                    let mut k = i + 2;
                    while k < n && chars[k] != '\'' {
                        k += 1;
                    }
                    k + 1
                } else {
                    i + 3
                };
            } else {
                out.push(Token::Ident(word));
            }
        } else if c == ':' && at(i + 1) == ':' {
            out.push(Token::PathSep);
            i += 2;
        } else {
            out.push(Token::Punct(c));
            i += 1;
        }
    }
    out
}

/// The index after a string whose opening quote is before `i`.
fn skip_string(chars: &[char], mut i: usize) -> usize {
    while i < chars.len() {
        match chars[i] {
            '\\' => i += 2,
            '"' => return i + 1,
            _ => i += 1,
        }
    }
    i
}

/// The index after a string that starts at `i` after its prefix (`r`, `b`, `br`…).
fn skip_prefixed_string(chars: &[char], mut i: usize, raw: bool) -> usize {
    if !raw {
        return skip_string(chars, i + 1);
    }
    let mut hashes = 0;
    while chars.get(i) == Some(&'#') {
        hashes += 1;
        i += 1;
    }
    i += 1; // the opening quote
    while i < chars.len() {
        if chars[i] == '"' && (1..=hashes).all(|k| chars.get(i + k) == Some(&'#')) {
            return i + 1 + hashes;
        }
        i += 1;
    }
    i
}

/// The module path of a file under `src/` by its place (`a/b.rs` and `a/b/mod.rs` are
/// `a::b`; `lib.rs` and `main.rs` the root).
fn module_path_of(relative: &Path) -> ModPath {
    let mut parts: Vec<String> = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if let Some(last) = parts.pop() {
        let stem = last.trim_end_matches(".rs");
        if !matches!(stem, "mod" | "lib" | "main") || parts.is_empty() && stem == "mod" {
            parts.push(stem.to_owned());
        }
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// One source file: where it sits in the module tree, and its tokens.
struct SourceFile {
    name: String,
    module: ModPath,
    tokens: Vec<Token>,
    /// `main.rs` is its own crate, and reaches the library as `ctxproxy::`.
    binary: bool,
}

/// Files included with `#[path = "x.rs"] mod name;`: their module is the includer's `name`,
/// not their place.
fn path_attributes(source: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut pending: Option<String> = None;
    for line in source.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("#[path = \"") {
            pending = rest.split('"').next().map(str::to_owned);
        } else if let Some(file) = pending.as_ref() {
            if line.starts_with("#[") {
                continue;
            }
            let declaration = line
                .trim_start_matches("pub ")
                .trim_start_matches("pub(crate) ");
            if let Some(name) = declaration
                .strip_prefix("mod ")
                .and_then(|r| r.strip_suffix(';'))
            {
                out.push((file.clone(), name.trim().to_owned()));
            }
            pending = None;
        }
    }
    out
}

fn load(src: &Path) -> Vec<SourceFile> {
    let mut paths = Vec::new();
    rust_files(src, &mut paths);
    let mut files: Vec<SourceFile> = Vec::new();
    let mut sources = Vec::new();
    for path in &paths {
        let relative = path.strip_prefix(src).unwrap_or(path).to_path_buf();
        let source = fs::read_to_string(path).unwrap_or_default();
        files.push(SourceFile {
            name: relative.to_string_lossy().replace('\\', "/"),
            module: module_path_of(&relative),
            tokens: tokens(&source),
            binary: relative == Path::new("main.rs"),
        });
        sources.push(source);
    }
    // `#[path]` includes take the includer's module plus their declared name.
    let mut renamed = Vec::new();
    for (includer, source) in files.iter().zip(&sources) {
        let dir = Path::new(&includer.name)
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        for (file, name) in path_attributes(source) {
            let included = dir.join(&file).to_string_lossy().replace('\\', "/");
            let mut module = includer.module.clone();
            module.push(name);
            renamed.push((included, module));
        }
    }
    for (included, module) in renamed {
        if let Some(file) = files.iter_mut().find(|f| f.name == included) {
            file.module = module;
        }
    }
    files
}

/// The crate's modules and what they re-export.
struct Crate {
    /// Every module and the file that defines it: file modules and the inline
    /// `mod name { … }` modules within them.
    modules: BTreeMap<ModPath, usize>,
    /// An item's path as a `pub use` makes it (the module's path and the name), and the path
    /// it names there (read from that module).
    reexports: BTreeMap<ModPath, (ModPath, Vec<String>)>,
}

fn crate_of(files: &[SourceFile]) -> Crate {
    let mut modules = BTreeMap::new();
    let mut reexports = BTreeMap::new();
    for (index, file) in files.iter().enumerate() {
        if file.binary {
            continue;
        }
        modules.insert(file.module.clone(), index);
        walk(file, &mut |event| match event {
            Event::InlineModule(path) => {
                modules.insert(path, index);
            }
            Event::Path {
                within,
                segments,
                exported: Some(name),
            } => {
                let mut item = within.clone();
                item.push(name);
                reexports.insert(item, (within, segments));
            }
            Event::Path { .. } => {}
        });
    }
    Crate { modules, reexports }
}

enum Event {
    InlineModule(ModPath),
    /// A path into the crate or relative to the current module, with the module it is read in.
    Path {
        within: ModPath,
        segments: Vec<String>,
        /// In a `pub use`: the name it gives the item (its last segment, or its alias).
        exported: Option<String>,
    },
}

/// Walks a file's tokens, tracking inline modules, and reports every module declared inline
/// and every path that may reach another module.
fn walk(file: &SourceFile, on: &mut dyn FnMut(Event)) {
    let tokens = &file.tokens;
    let mut depth = 0usize;
    // (module name, the brace depth inside it, a `#[cfg(test)]` module)
    let mut inline: Vec<(String, usize, bool)> = Vec::new();
    let within = |inline: &[(String, usize, bool)]| {
        let mut m = file.module.clone();
        m.extend(inline.iter().map(|(name, _, _)| name.clone()));
        m
    };
    let in_test = |inline: &[(String, usize, bool)]| inline.iter().any(|(_, _, test)| *test);
    let mut i = 0;
    while i < tokens.len() {
        match &tokens[i] {
            Token::Punct('{') => depth += 1,
            Token::Punct('}') => {
                if inline.last().is_some_and(|(_, d, _)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
            }
            Token::Ident(word) if word == "mod" => {
                if let (Some(Token::Ident(name)), Some(Token::Punct('{'))) =
                    (tokens.get(i + 1), tokens.get(i + 2))
                {
                    depth += 1;
                    inline.push((name.clone(), depth, is_cfg_test(&tokens[..i])));
                    on(Event::InlineModule(within(&inline)));
                    i += 3;
                    continue;
                }
            }
            Token::Ident(word) if word == "use" => {
                let end = (i + 1..tokens.len())
                    .find(|&k| tokens[k] == Token::Punct(';'))
                    .unwrap_or(tokens.len());
                let mut paths = Vec::new();
                use_tree(&tokens[i + 1..end], &[], &mut paths);
                let public = is_public(&tokens[..i]);
                for (segments, name) in paths.into_iter().filter(|_| !in_test(&inline)) {
                    on(Event::Path {
                        within: within(&inline),
                        segments,
                        exported: name.filter(|_| public),
                    });
                }
                i = end + 1;
                continue;
            }
            Token::Ident(word) => {
                let after_separator = i > 0 && tokens[i - 1] == Token::PathSep;
                if !after_separator
                    && tokens.get(i + 1) == Some(&Token::PathSep)
                    && !in_test(&inline)
                {
                    let mut segments = vec![word.clone()];
                    let mut k = i + 1;
                    while tokens.get(k) == Some(&Token::PathSep) {
                        match tokens.get(k + 1) {
                            Some(Token::Ident(next)) => segments.push(next.clone()),
                            _ => break,
                        }
                        k += 2;
                    }
                    on(Event::Path {
                        within: within(&inline),
                        segments,
                        exported: None,
                    });
                    i = k;
                    continue;
                }
            }
            _ => {}
        }
        i += 1;
    }
}

/// Whether the item after `before` is under `#[cfg(test)]` (other attributes may follow it).
fn is_cfg_test(before: &[Token]) -> bool {
    let mut end = before.len();
    // Attributes between `#[cfg(test)]` and the item: `#[path = …]`, `#[expect(…)]`.
    while end > 0 && before[end - 1] == Token::Punct(']') {
        let Some(open) = before[..end].iter().rposition(|t| *t == Token::Punct('#')) else {
            return false;
        };
        let cfg_test = [
            Token::Punct('#'),
            Token::Punct('['),
            Token::Ident("cfg".into()),
            Token::Punct('('),
            Token::Ident("test".into()),
            Token::Punct(')'),
            Token::Punct(']'),
        ];
        if before[open..end] == cfg_test {
            return true;
        }
        end = open;
    }
    false
}

/// Whether the `use` after `before` is public (`pub use`, `pub(crate) use`).
fn is_public(before: &[Token]) -> bool {
    match before {
        [.., Token::Ident(word)] => word == "pub",
        [
            ..,
            Token::Ident(word),
            Token::Punct('('),
            _,
            Token::Punct(')'),
        ] => word == "pub",
        _ => false,
    }
}

/// The paths a `use` tree names (`a::{b, c::{d, self}}` → `a::b`, `a::c::d`, `a::c`), each
/// with the name it brings in (`None` for a glob).
fn use_tree(tokens: &[Token], prefix: &[String], out: &mut Vec<(Vec<String>, Option<String>)>) {
    for group in split_top_level(tokens) {
        let mut segments = prefix.to_vec();
        let mut nested = false;
        let mut name = None;
        let mut i = 0;
        while i < group.len() {
            match &group[i] {
                // An alias or a glob ends the path: a glob reaches the module itself.
                Token::Ident(word) if word == "as" => {
                    if let Some(Token::Ident(alias)) = group.get(i + 1) {
                        name = Some(alias.clone());
                    }
                    break;
                }
                Token::Punct('*') => {
                    name = Some(String::new());
                    break;
                }
                // `a::{self}` is the module `a`; a leading `self::` is kept to resolve.
                Token::Ident(word) if word == "self" && !segments.is_empty() => {}
                Token::Ident(word) => segments.push(word.clone()),
                Token::Punct('{') => {
                    let close = matching_brace(group, i);
                    use_tree(&group[i + 1..close.min(group.len())], &segments, out);
                    nested = true;
                    break;
                }
                _ => {}
            }
            i += 1;
        }
        if !nested && !segments.is_empty() {
            let name = match name {
                Some(glob) if glob.is_empty() => None,
                Some(alias) => Some(alias),
                None => segments.last().cloned(),
            };
            out.push((segments, name));
        }
    }
}

fn matching_brace(tokens: &[Token], open: usize) -> usize {
    let mut depth = 0;
    for (k, token) in tokens.iter().enumerate().skip(open) {
        match token {
            Token::Punct('{') => depth += 1,
            Token::Punct('}') => {
                depth -= 1;
                if depth == 0 {
                    return k;
                }
            }
            _ => {}
        }
    }
    tokens.len()
}

fn split_top_level(tokens: &[Token]) -> Vec<&[Token]> {
    let mut groups = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (k, token) in tokens.iter().enumerate() {
        match token {
            Token::Punct('{') => depth += 1,
            Token::Punct('}') => depth -= 1,
            Token::Punct(',') if depth == 0 => {
                groups.push(&tokens[start..k]);
                start = k + 1;
            }
            _ => {}
        }
    }
    groups.push(&tokens[start..]);
    groups.retain(|g| !g.is_empty());
    groups
}

/// The absolute module path `segments` names from `within`, when it is a path into this crate.
fn absolute(
    within: &[String],
    segments: &[String],
    binary: bool,
    modules: &BTreeMap<ModPath, usize>,
) -> Option<ModPath> {
    let first = segments.first()?;
    if binary {
        if first != "ctxproxy" {
            return None;
        }
        return Some(segments[1..].to_vec());
    }
    let mut base: ModPath = within.to_vec();
    let rest: &[String] = match first.as_str() {
        "crate" => {
            base.clear();
            &segments[1..]
        }
        "self" => &segments[1..],
        "super" => {
            let mut k = 0;
            while segments.get(k).is_some_and(|s| s == "super") {
                base.pop()?;
                k += 1;
            }
            &segments[k..]
        }
        _ => {
            let mut child = base.clone();
            child.push(first.clone());
            if !modules.contains_key(&child) {
                return None;
            }
            segments
        }
    };
    base.extend(rest.iter().filter(|s| *s != "self").cloned());
    Some(base)
}

/// The files `path` reaches: the file of its longest prefix that is a module and, when the
/// item after that prefix is a `pub use`, the files of what it re-exports, hop by hop (the
/// importer depends on the re-exporting file and on the defining one).
fn reached_files(path: &[String], krate: &Crate) -> Vec<usize> {
    let mut path = path.to_vec();
    let mut files = Vec::new();
    // Bounded: a re-export that names itself ends the walk.
    for _ in 0..16 {
        let Some(k) = (0..=path.len())
            .rev()
            .find(|&k| krate.modules.contains_key(&path[..k]))
        else {
            break;
        };
        files.extend(krate.modules.get(&path[..k]).copied());
        if k == path.len() {
            break;
        }
        let Some((within, segments)) = krate.reexports.get(&path[..=k]) else {
            break;
        };
        let Some(mut target) = absolute(within, segments, false, &krate.modules) else {
            break;
        };
        target.extend_from_slice(&path[k + 1..]);
        if target == path {
            break;
        }
        path = target;
    }
    files
}

/// Edges between files, each with the first path that draws it.
fn graph(files: &[SourceFile]) -> BTreeMap<(usize, usize), String> {
    let krate = crate_of(files);
    let mut edges = BTreeMap::new();
    for (index, file) in files.iter().enumerate() {
        walk(file, &mut |event| {
            let Event::Path {
                within, segments, ..
            } = event
            else {
                return;
            };
            let Some(path) = absolute(&within, &segments, file.binary, &krate.modules) else {
                return;
            };
            for target in reached_files(&path, &krate) {
                let descendant = files[target].module.starts_with(&files[index].module);
                if target != index && !descendant {
                    edges
                        .entry((index, target))
                        .or_insert_with(|| segments.join("::"));
                }
            }
        });
    }
    edges
}

/// Strongly connected components with more than one file (Tarjan).
fn circles(count: usize, edges: &BTreeMap<(usize, usize), String>) -> Vec<Vec<usize>> {
    let mut next: Vec<Vec<usize>> = vec![Vec::new(); count];
    for &(from, to) in edges.keys() {
        next[from].push(to);
    }
    struct Tarjan<'a> {
        next: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        counter: usize,
        out: Vec<Vec<usize>>,
    }
    impl Tarjan<'_> {
        fn visit(&mut self, v: usize) {
            self.index[v] = Some(self.counter);
            self.low[v] = self.counter;
            self.counter += 1;
            self.stack.push(v);
            self.on_stack[v] = true;
            for k in 0..self.next[v].len() {
                let w = self.next[v][k];
                match self.index[w] {
                    None => {
                        self.visit(w);
                        self.low[v] = self.low[v].min(self.low[w]);
                    }
                    Some(iw) if self.on_stack[w] => self.low[v] = self.low[v].min(iw),
                    Some(_) => {}
                }
            }
            if Some(self.low[v]) == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack[w] = false;
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.out.push(component);
                }
            }
        }
    }
    let mut tarjan = Tarjan {
        next: &next,
        index: vec![None; count],
        low: vec![0; count],
        on_stack: vec![false; count],
        stack: Vec::new(),
        counter: 0,
        out: Vec::new(),
    };
    for v in 0..count {
        if tarjan.index[v].is_none() {
            tarjan.visit(v);
        }
    }
    tarjan.out
}

/// One loop through `component`, from its first file back to it (breadth-first, so shortest).
fn one_loop(component: &[usize], edges: &BTreeMap<(usize, usize), String>) -> Vec<usize> {
    let members: BTreeSet<usize> = component.iter().copied().collect();
    let start = component[0];
    let mut came_from: BTreeMap<usize, usize> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(v) = queue.pop_front() {
        for &(from, to) in edges.keys() {
            if from != v || !members.contains(&to) {
                continue;
            }
            if to == start {
                let mut path = vec![start];
                let mut at = v;
                while at != start {
                    path.push(at);
                    at = came_from[&at];
                }
                path.push(start);
                let last = path.len() - 1;
                path[1..last].reverse();
                return path;
            }
            if let std::collections::btree_map::Entry::Vacant(e) = came_from.entry(to) {
                e.insert(v);
                queue.push_back(to);
            }
        }
    }
    vec![start]
}

fn describe(files: &[SourceFile], edges: &BTreeMap<(usize, usize), String>) -> Vec<String> {
    let mut report = Vec::new();
    for component in circles(files.len(), edges) {
        let names: Vec<&str> = component.iter().map(|&f| files[f].name.as_str()).collect();
        let mut text = format!("circle among {} files: {}\n", names.len(), names.join(", "));
        let path = one_loop(&component, edges);
        text.push_str("  for example:\n");
        for pair in path.windows(2) {
            let via = edges.get(&(pair[0], pair[1])).map_or("?", String::as_str);
            text.push_str(&format!(
                "    {} -> {}   ({})\n",
                files[pair[0]].name, files[pair[1]].name, via
            ));
        }
        text.push_str("  imports inside the circle:\n");
        for (&(from, to), via) in edges {
            if component.contains(&from) && component.contains(&to) {
                text.push_str(&format!(
                    "    {} -> {}   ({via})\n",
                    files[from].name, files[to].name
                ));
            }
        }
        report.push(text);
    }
    report
}

#[test]
fn no_file_under_src_imports_itself_through_a_loop() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = load(&src);
    assert!(files.len() > 50, "the sources were not found under {src:?}");
    let edges = graph(&files);
    let report = describe(&files, &edges);
    assert!(
        report.is_empty(),
        "the module graph has {} circle(s):\n\n{}",
        report.len(),
        report.join("\n")
    );
}

#[cfg(test)]
mod reader {
    use super::*;

    fn file(name: &str, module: &[&str], source: &str) -> SourceFile {
        SourceFile {
            name: name.to_owned(),
            module: module.iter().map(|s| (*s).to_owned()).collect(),
            tokens: tokens(source),
            binary: false,
        }
    }

    fn edge_names(files: &[SourceFile]) -> Vec<(String, String)> {
        graph(files)
            .keys()
            .map(|&(a, b)| (files[a].name.clone(), files[b].name.clone()))
            .collect()
    }

    #[test]
    fn grouped_relative_and_inline_paths_are_edges_and_literals_are_not() {
        let files = vec![
            file("lib.rs", &[], "mod a; mod b; mod c;"),
            file(
                "a.rs",
                &["a"],
                r##"use crate::{b::{self, X}, c::Y as Z};
                // crate::lib_only::Nothing
                const S: &str = "super::c::Q"; const R: &str = r#"crate::c"#;
                fn f<'a>(x: &'a str) -> char { let _ = 'c'; '\'' }
                #[cfg(test)] mod tests { use super::*; use crate::c::Test; }"#,
                "##,
            ),
            file("b.rs", &["b"], "fn g() { super::c::h(); }"),
            file(
                "c.rs",
                &["c"],
                "pub(crate) fn h() {} mod inner { fn i() { self::j(); } }",
            ),
        ];
        assert_eq!(
            edge_names(&files),
            vec![
                ("a.rs".to_owned(), "b.rs".to_owned()),
                ("a.rs".to_owned(), "c.rs".to_owned()),
                ("b.rs".to_owned(), "c.rs".to_owned()),
            ]
        );
    }

    #[test]
    fn a_loop_is_found_and_named() {
        let files = vec![
            file("lib.rs", &[], "mod p; mod s;"),
            file("p/mod.rs", &["p"], "mod q; mod r; pub struct S;"),
            file("p/q.rs", &["p", "q"], "use super::r::T;"),
            file("p/r.rs", &["p", "r"], "fn f() { crate::s::g(); }"),
            file("s.rs", &["s"], "use crate::p::{q::U, S};"),
        ];
        let edges = graph(&files);
        let report = describe(&files, &edges);
        assert_eq!(report.len(), 1, "{report:?}");
        assert!(
            report[0].contains("circle among 3 files: p/q.rs, p/r.rs, s.rs"),
            "{}",
            report[0]
        );
    }

    #[test]
    fn a_parent_reaching_into_its_children_is_the_module_tree_not_an_import() {
        let files = vec![
            file("lib.rs", &[], "mod p;"),
            file(
                "p/mod.rs",
                &["p"],
                "mod q; pub use q::T; pub struct S; fn f() { self::q::g(); }",
            ),
            file("p/q.rs", &["p", "q"], "use super::S;"),
        ];
        assert_eq!(
            edge_names(&files),
            vec![("p/q.rs".to_owned(), "p/mod.rs".to_owned())]
        );
    }

    #[test]
    fn a_re_export_reaches_the_re_exporting_file_and_the_defining_one() {
        let files = vec![
            file("lib.rs", &[], "mod p; mod s;"),
            file(
                "p/mod.rs",
                &["p"],
                "mod q; pub use q::T; pub(crate) use self::q::U as V;",
            ),
            file("p/q.rs", &["p", "q"], "fn f() { crate::s::g(); }"),
            file("s.rs", &["s"], "use crate::p::{T, V};"),
        ];
        assert_eq!(
            edge_names(&files),
            vec![
                ("p/q.rs".to_owned(), "s.rs".to_owned()),
                ("s.rs".to_owned(), "p/mod.rs".to_owned()),
                ("s.rs".to_owned(), "p/q.rs".to_owned()),
            ]
        );
    }

    #[test]
    fn a_test_module_imports_for_itself_not_for_its_file() {
        let files = vec![
            file("lib.rs", &[], "mod a; mod b;"),
            file("a.rs", &["a"], "use crate::b::X;"),
            file(
                "b.rs",
                &["b"],
                "pub struct X; #[cfg(test)] #[expect(dead_code)] mod tests { use crate::a::Y; }",
            ),
        ];
        assert_eq!(
            edge_names(&files),
            vec![("a.rs".to_owned(), "b.rs".to_owned())]
        );
    }

    #[test]
    fn files_map_to_their_modules() {
        let m = |p: &str| module_path_of(Path::new(p));
        assert_eq!(m("lib.rs"), Vec::<String>::new());
        assert_eq!(m("a/mod.rs"), vec!["a"]);
        assert_eq!(m("a/b.rs"), vec!["a", "b"]);
        assert_eq!(m("a/b/mod.rs"), vec!["a", "b"]);
    }
}
