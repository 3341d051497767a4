//! Name patterns (`gpt-*`, `qwen?`) for models and tools: a leaf the config, the metrics and
//! the pipeline stages all match names with, so none of them imports another for it.

/// `*` matches any run of characters, `?` one character; everything else is literal.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    // Most names are ASCII: their bytes are their characters, and nothing is allocated.
    if pattern.is_ascii() && text.is_ascii() {
        return matches(pattern.as_bytes(), text.as_bytes(), b'*', b'?');
    }
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    matches(&p, &t, '*', '?')
}

/// The match of `glob_match` over symbols: `star` matches any run of them, `any` one.
fn matches<T: Copy + PartialEq>(p: &[T], t: &[T], star: T, any: T) -> bool {
    let (mut pi, mut ti) = (0, 0);
    let mut backtrack: Option<(usize, usize)> = None;
    while ti < t.len() {
        match p.get(pi) {
            Some(&c) if c == star => {
                backtrack = Some((pi, ti));
                pi += 1;
            }
            Some(&c) if c == any || c == t[ti] => {
                pi += 1;
                ti += 1;
            }
            _ => match backtrack {
                Some((at, matched)) => {
                    pi = at + 1;
                    ti = matched + 1;
                    backtrack = Some((at, matched + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == star)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob() {
        assert!(glob_match("gpt-*", "gpt-4o"));
        assert!(glob_match("*", ""));
        assert!(glob_match("*-mini", "gpt-4o-mini"));
        assert!(glob_match("a*b*c", "aXbYbZc"));
        assert!(!glob_match("gpt-*", "chatgpt-4o"));
        assert!(!glob_match("gpt-4o", "gpt-4o-mini"));
        // `?` is one character, not one byte.
        assert!(glob_match("caf?", "café"));
        assert!(glob_match("*é-?", "modèle-é-x"));
        assert!(!glob_match("caf??", "café"));
    }
}
