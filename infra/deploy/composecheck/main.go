// Usage: go build -o /tmp/composecheck . && MINIO_ROOT_PASSWORD=x /tmp/composecheck ../compose.yaml
// Loads a compose file the way `docker compose config` does (compose-go: interpolation,
// merge keys, schema validation, normalisation, reference checks) and prints the result.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/compose-spec/compose-go/v2/cli"
)

func main() {
	opts, err := cli.NewProjectOptions([]string{os.Args[1]}, cli.WithOsEnv, cli.WithName("spanrl"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	p, err := opts.LoadProject(context.Background())
	if err != nil {
		fmt.Fprintln(os.Stderr, "INVALID:", err)
		os.Exit(1)
	}
	out, _ := p.MarshalYAML()
	fmt.Println(string(out))
	fmt.Fprintf(os.Stderr, "OK: %d services\n", len(p.Services))
}
