// A steady HTTP /pub load for bench/up.py's ack case: -c keep-alive connections together send
// -rate requests a second, each request sent when it is due and timed from then (a request
// held up behind a slow answer counts its wait). The first 2 s are not measured. Prints one
// line: n, p50, p95, p99 and max in ms.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"sort"
	"sync"
	"time"
)

func main() {
	url := flag.String("url", "", "the /pub URL, topic included")
	rate := flag.Int("rate", 1000, "requests a second, all connections together")
	conns := flag.Int("c", 16, "connections")
	seconds := flag.Float64("s", 10, "seconds measured, after 2 s unmeasured")
	size := flag.Int("size", 200, "body bytes")
	flag.Parse()
	body := bytes.Repeat([]byte("x"), *size)
	start := time.Now()
	end := start.Add(time.Duration((2 + *seconds) * float64(time.Second)))
	interval := time.Duration(float64(*conns) / float64(*rate) * float64(time.Second))
	var mu sync.Mutex
	var all []float64
	var wg sync.WaitGroup
	failed := make(chan error, *conns)
	for i := 0; i < *conns; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
			due := start.Add(time.Duration(float64(i) / float64(*conns) * float64(interval)))
			var mine []float64
			for due.Before(end) {
				if wait := time.Until(due); wait > 0 {
					time.Sleep(wait)
				}
				resp, err := client.Post(*url, "application/octet-stream", bytes.NewReader(body))
				if err != nil {
					failed <- err
					return
				}
				answer, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 || string(answer) != "OK" {
					failed <- fmt.Errorf("answered %d %q", resp.StatusCode, answer)
					return
				}
				if due.Sub(start) >= 2*time.Second {
					mine = append(mine, float64(time.Since(due).Microseconds())/1000)
				}
				due = due.Add(interval)
			}
			mu.Lock()
			all = append(all, mine...)
			mu.Unlock()
		}(i)
	}
	wg.Wait()
	close(failed)
	if err := <-failed; err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	sort.Float64s(all)
	n := len(all)
	if n == 0 {
		fmt.Fprintln(os.Stderr, "no answers measured")
		os.Exit(1)
	}
	fmt.Printf("n=%d p50=%.3f p95=%.3f p99=%.3f max=%.3f\n", n, all[n/2], all[n*95/100], all[n*99/100], all[n-1])
}
