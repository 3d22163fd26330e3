from test_two_hosts import concurrently, requests, served, one_host, link, model_dir  # noqa: F401


def test_repeat_eight_concurrent(served, one_host):
    bad = []
    for attempt in range(25):
        replies = concurrently(served, requests())
        got = [reply.token_ids for reply in replies]
        for i, (g, want) in enumerate(zip(got, one_host)):
            if g != want:
                first = next((k for k, (a, b) in enumerate(zip(g, want)) if a != b), min(len(g), len(want)))
                bad.append((attempt, i, first))
                print("DIVERGED attempt", attempt, "request", i, "at", first, flush=True)
    print("bad", bad)
    assert not bad
